"""The engines' HTTP keep-alive, which every shipped Envoy config closes idle engine connections under: the
unit test of the configs and the end-to-end test through a real Envoy read it here."""

ENGINE_KEEP_ALIVE_S = 5.0
"""How long the engine's HTTP server keeps an idle keep-alive connection open. vLLM 0.32.0 runs uvicorn with
`timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE` (vllm/entrypoints/launchers/api_server/entry.py), whose
default is 5 ("Timeout in seconds for keeping HTTP connections alive in API server", vllm/envs.py); uvicorn's
own default is 5 as well (uvicorn 0.55.0, uvicorn/config.py: `timeout_keep_alive: int = 5`), and SGLang passes
`timeout_keep_alive=5` (sgl-project/sglang python/sglang/srt/entrypoints/http_server.py @ 0025436e)."""
