"""Envoy ext_proc sidecar that keeps LLM inference backends inside their KV-cache budget."""

__version__ = "0.1.0"
