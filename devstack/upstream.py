"""`make run UPSTREAM=http://host:port`: the local stack in front of an OpenAI-compatible server of one's own
(vLLM, SGLang) instead of the simulator.

What the stack needs of the server it reads from the server itself: its served model and context window
from `/v1/models` (vLLM's model card carries `max_model_len`), its KV cache from `/metrics` (the exporter
scrapes it, so the feed, the adaptive scale and the KV budget run as in a cluster). The sidecar's config is
`config/local.yaml` made to fit: its limits and policy for the simulator's model move to the served one, with
the server's window and the template costs left at their defaults (a template's measured costs belong to its
model family: docs/configuration.md).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import yaml

SIMULATED_MODEL = "llama-3-8b"
"""The model config/local.yaml names: the simulator's."""


class UpstreamError(RuntimeError):
    """The upstream cannot be used as given; the message says why and what to do."""


@dataclass(frozen=True)
class Upstream:
    url: str
    host: str
    port: int
    model: str
    context_window: int | None

    @classmethod
    def parse(cls, url: str) -> tuple[str, str, int]:
        """(base URL, host, port) of an `http://host[:port]` URL; anything else is refused with the reason."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise UpstreamError(
                f"--upstream {url!r}: give http://HOST:PORT (the local stack speaks plain HTTP to its "
                "upstream; an https engine is for the Kubernetes gateway: k8s/README.md)"
            )
        if parts.path.strip("/"):
            raise UpstreamError(f"--upstream {url!r}: give the server's root, without a path")
        port = parts.port or 80
        return f"http://{parts.netloc}", parts.hostname, port

    @classmethod
    def discover(cls, url: str, timeout_s: float = 10.0) -> Upstream:
        """The server at `url` and the model it serves (the first its `/v1/models` lists)."""
        base, host, port = cls.parse(url)
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout_s) as resp:
                listing = json.load(resp)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise UpstreamError(
                f"{base}/v1/models: {exc} (is the server up, and OpenAI-compatible?)"
            ) from None
        cards = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
            raise UpstreamError(f"{base}/v1/models lists no model")
        card = cards[0]
        window = card.get("max_model_len")
        return cls(
            url=base,
            host=host,
            port=port,
            model=str(card.get("id")),
            context_window=window if isinstance(window, int) and window > 0 else None,
        )

    def sidecar_config(self, local: dict[str, Any]) -> dict[str, Any]:
        """`local` (config/local.yaml) for this server: the simulator's model entries become the served
        model's, with the server's context window and no template costs of another model family."""
        config = yaml.safe_load(yaml.safe_dump(local))  # a deep copy
        models = config.setdefault("models", {})
        entry = models.pop(SIMULATED_MODEL, {})
        entry.pop("template", None)
        if self.context_window is not None:
            entry["context_window"] = self.context_window
            models.setdefault("*", {})["context_window"] = self.context_window
        models[self.model] = entry
        limits = config.get("limits", {}).get("models", {})
        if SIMULATED_MODEL in limits:
            limits[self.model] = limits.pop(SIMULATED_MODEL)
        return dict(config)
