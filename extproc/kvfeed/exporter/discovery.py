"""Where the exporter's targets come from: a static list, or inference pods on its own node.

Kubernetes discovery lists pods through the API server (`GET /api/v1/pods?labelSelector=...&
fieldSelector=spec.nodeName=<NODE_NAME>`) with the pod's service-account token and CA at the standard
in-cluster paths, and re-lists every `relist_seconds`. A failed listing keeps the last good list: an API
server hiccup must not make every target vanish. Per-pod settings come from annotations:

* `extproc.io/metrics-port` (else the `--pod-port` default) and `extproc.io/metrics-path`
  (else the kind's default: `/metrics`, or `/prometheus/metrics` for trtllm-serve);
* `extproc.io/server-kind` (else `--pod-kind`, else auto-detect);
* `extproc.io/model` (else the model label in the page).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlencode

import aiohttp

from extproc.kvfeed.engines import PROFILES
from extproc.kvfeed.targets import Target, parse_kind

log = logging.getLogger(__name__)

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ANNOTATION_PORT = "extproc.io/metrics-port"
ANNOTATION_PATH = "extproc.io/metrics-path"
ANNOTATION_KIND = "extproc.io/server-kind"
ANNOTATION_MODEL = "extproc.io/model"


class Discovery(Protocol):
    async def refresh(self) -> list[Target]: ...


class StaticDiscovery:
    """A fixed list (flags or YAML file)."""

    def __init__(self, targets: list[Target]) -> None:
        self._targets = list(targets)

    async def refresh(self) -> list[Target]:
        return list(self._targets)


@dataclass(frozen=True, slots=True)
class KubeDiscoveryConfig:
    label_selector: str
    node_name: str
    api_url: str = "https://kubernetes.default.svc"
    namespace: str | None = None  # None: all namespaces (needs a ClusterRole)
    default_port: int | None = 8000
    default_kind: str | None = None
    token_path: Path = SA_DIR / "token"
    ca_path: Path | None = SA_DIR / "ca.crt"
    relist_seconds: float = 30.0
    request_timeout: float = 5.0


class KubeDiscovery:
    """Pods on this node matching a label selector, as scrape targets."""

    def __init__(self, session: aiohttp.ClientSession, config: KubeDiscoveryConfig) -> None:
        if not config.node_name:
            raise ValueError("discovery.node_name: required (set NODE_NAME from the downward API)")
        self._session = session
        self._cfg = config
        self._ssl: ssl.SSLContext | None = None
        if config.api_url.startswith("https") and config.ca_path is not None and config.ca_path.exists():
            self._ssl = ssl.create_default_context(cafile=str(config.ca_path))

    def _url(self) -> str:
        cfg = self._cfg
        base = cfg.api_url.rstrip("/")
        path = f"/api/v1/namespaces/{cfg.namespace}/pods" if cfg.namespace else "/api/v1/pods"
        query = urlencode(
            {"labelSelector": cfg.label_selector, "fieldSelector": f"spec.nodeName={cfg.node_name}"}
        )
        return f"{base}{path}?{query}"

    def _headers(self) -> dict[str, str]:
        # Re-read every time: projected service-account tokens are rotated by the kubelet.
        try:
            token = self._cfg.token_path.read_text().strip()
        except OSError:
            return {}
        return {"Authorization": f"Bearer {token}"}

    async def refresh(self) -> list[Target]:
        """One listing; raises on API errors (the caller keeps the last good list)."""
        timeout = aiohttp.ClientTimeout(total=self._cfg.request_timeout)
        async with self._session.get(
            self._url(), headers=self._headers(), ssl=self._ssl if self._ssl else True, timeout=timeout
        ) as resp:
            if resp.status != 200:
                raise RuntimeError(f"pod list failed: HTTP {resp.status}")
            body = await resp.json()
        return self.targets_from_pod_list(body)

    def targets_from_pod_list(self, body: Mapping[str, Any]) -> list[Target]:
        out: list[Target] = []
        for pod in body.get("items") or []:
            target = self._target(pod)
            if target is not None:
                out.append(target)
        return sorted(out, key=lambda t: t.url)

    def _target(self, pod: Mapping[str, Any]) -> Target | None:
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
            return None
        ann: Mapping[str, str] = meta.get("annotations") or {}
        try:
            port = int(ann.get(ANNOTATION_PORT) or self._cfg.default_port or 0)
            kind = parse_kind(ann.get(ANNOTATION_KIND) or self._cfg.default_kind)
            if not 0 < port < 65536:
                raise ValueError(f"no metrics port (annotation {ANNOTATION_PORT})")
            path = ann.get(ANNOTATION_PATH) or (PROFILES[kind].metrics_path if kind else "/metrics")
            if not path.startswith("/"):
                path = "/" + path
            ip = status["podIP"]
            host = f"[{ip}]" if ":" in ip else ip
            return Target(
                url=f"http://{host}:{port}{path}", kind=kind, model=ann.get(ANNOTATION_MODEL) or None
            )
        except ValueError as exc:
            log.warning("skipping pod with bad annotations", extra={"pod": name, "error": str(exc)})
            return None
