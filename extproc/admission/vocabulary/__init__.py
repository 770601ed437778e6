"""What a request and its answer are, in the words every admission layer above uses: a body parsed
into a `ParsedRequest`, its prompt and count, the model's policy, field validation and OpenAI error bodies,
the names the sidecar shares with its Envoy configs, the usage an answer reports and the Lua read spec.
"""
