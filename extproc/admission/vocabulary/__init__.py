"""What a request and its answer are, in the words every admission layer above uses: a body parsed
into a `ParsedRequest`, its prompt and count, the model's policy, field validation and OpenAI error bodies,
the names the sidecar shares with its Envoy configs, the usage an answer reports and the Lua read spec.

Modules, by their path from this folder: what a request and its answer are, in the words every admission row
above uses (imports no other admission row): `parsed.py` (what an adapter makes of a body: the `Api` name,
`ParsedRequest`, `BodyEdits`), `body.py` (`BodyFormat`: an API's body decoded from its bytes and content type
and encoded after edits; `JSON_BODY`, every JSON API's), `fields.py` (field validation every adapter shares,
each error naming the field), `errors.py` (OpenAI error bodies), `prompt.py` (a request's prompt as the meter
sees it, its bounds and its count), `policy.py` (the policies a request does not state: `ModelPolicy`, what
admission knows of a served model (template and media costs, a missing output bound), `ClassPolicy`, a
priority class's queue and priority, and vLLM's per-step bounds), `tokens.py` (tiktoken counting, shared with
the simulator), `prefix.py` (a prompt's leading text as chained chunk hashes, what the budget's prefix sharing
compares), `names.py` (every header, metadata and request-attribute name the sidecar and its Envoy configs
share), `usage.py` (usage from SSE/JSON responses: `Usage`, `Observed` and the `Dialect` interface),
`readspec.py` (`ReadSpec`: the Lua patterns the lean profile's response reader applies, and those every API
shares).
"""
