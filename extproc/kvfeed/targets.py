"""Scrape targets: where an inference server's metrics live, what kind it is, which model it serves.

Static targets come from repeated `--target` flags or a YAML file; Kubernetes discovery builds the same
`Target` objects from pods, so the scraper does not care where a target came from.

Flag syntax: comma-separated key=value pairs, `url` required:
    --target url=http://127.0.0.1:8000/metrics,kind=vllm,model=meta-llama/Llama-3.1-8B-Instruct
YAML file (`--targets-file`):
    targets:
      - url: http://127.0.0.1:8000/metrics
        kind: vllm          # optional: auto-detected from metric prefixes
        model: llama-8b     # optional: the served model name (pool) when the page does not say it
                            # (TGI and trtllm-serve are otherwise asked at /v1/models; Triton's label
                            # is its model repository name, often not what clients send)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from extproc.kvfeed.engines import ServerKind

_KEYS = frozenset({"url", "kind", "model"})


@dataclass(frozen=True, slots=True)
class Target:
    """One metrics URL. `endpoint` (host:port) identifies the server in samples."""

    url: str
    kind: ServerKind | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"target.url: expected http(s)://host[:port]/path, got {self.url!r}")

    @property
    def endpoint(self) -> str:
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or ""
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def sibling_url(self, path: str) -> str:
        """`path` on the same scheme, host and port as the metrics page (e.g. the server's /v1/models)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}{path}"


def parse_kind(value: Any) -> ServerKind | None:
    """A target's `kind`: None (auto-detect) for empty or "auto", else a known ServerKind."""
    if value in (None, "", "auto"):
        return None
    try:
        return ServerKind(str(value))
    except ValueError:
        allowed = ", ".join(k.value for k in ServerKind)
        raise ValueError(f"target.kind: {value!r} is not one of auto, {allowed}") from None


def target_from_mapping(data: dict[str, Any]) -> Target:
    unknown = set(data) - _KEYS
    if unknown:
        raise ValueError(f"target: unknown key(s) {sorted(unknown)}; allowed {sorted(_KEYS)}")
    if not data.get("url"):
        raise ValueError("target.url: required")
    model = data.get("model")
    kind = parse_kind(data.get("kind"))
    return Target(url=str(data["url"]), kind=kind, model=str(model) if model else None)


def parse_target_spec(spec: str) -> Target:
    """`url=...,kind=...,model=...` (the value of one --target flag)."""
    data: dict[str, Any] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"target: expected key=value, got {part!r} in {spec!r}")
        data[key.strip()] = value.strip()
    return target_from_mapping(data)


def load_targets_file(path: str | Path) -> list[Target]:
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("targets"), list):
        raise ValueError(f"{path}: expected a mapping with a 'targets' list")
    out = []
    for i, item in enumerate(doc["targets"]):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: targets[{i}] must be a mapping")
        try:
            out.append(target_from_mapping(item))
        except ValueError as exc:
            raise ValueError(f"{path}: targets[{i}]: {exc}") from None
    return out
