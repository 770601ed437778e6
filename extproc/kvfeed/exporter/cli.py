"""Command line of the node exporter (`python -m extproc.kvfeed.exporter --help`)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
from collections.abc import Sequence
from pathlib import Path

from extproc.kvfeed.exporter.app import DEFAULT_GRPC_PORT, DEFAULT_METRICS_PORT, Exporter, ExporterConfig
from extproc.kvfeed.exporter.discovery import SA_DIR, KubeDiscoveryConfig
from extproc.kvfeed.targets import Target, load_targets_file, parse_target_spec
from extproc.logs import setup_logging

log = logging.getLogger("extproc.kvfeed.exporter")


def _hostport(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected [host]:port, got {value!r}")
    return (host.strip("[]") or "0.0.0.0", int(port))


def _default_api_url() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST", "kubernetes.default.svc")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{port}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m extproc.kvfeed.exporter",
        description=(
            "Scrape the KV-cache and queue metrics of inference servers (vLLM, SGLang, TGI, trtllm-serve, "
            "Triton TRT-LLM) on this node and stream normalized samples to sidecars over gRPC (KvFeed.Watch)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="node name put in samples and used to select pods (env NODE_NAME)",
    )
    p.add_argument(
        "--grpc-address",
        type=_hostport,
        default=f"0.0.0.0:{DEFAULT_GRPC_PORT}",
        metavar="HOST:PORT",
        help="KvFeed + gRPC health listen address",
    )
    p.add_argument(
        "--metrics-address",
        type=_hostport,
        default=f"0.0.0.0:{DEFAULT_METRICS_PORT}",
        metavar="HOST:PORT",
        help="own Prometheus /metrics and /healthz listen address",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between scrape rounds")
    p.add_argument("--timeout", type=float, default=0.8, help="per-target scrape timeout in seconds")
    p.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="url=URL[,kind=KIND][,model=NAME]",
        help="static target (repeatable); kind in vllm|sglang|tgi|trtllm|triton|auto",
    )
    p.add_argument("--targets-file", type=Path, help="YAML file with a 'targets' list of {url, kind, model}")
    k = p.add_argument_group("Kubernetes discovery (pods on this node)")
    k.add_argument("--kube-label-selector", help="enable discovery: label selector of inference pods")
    k.add_argument("--kube-namespace", help="only this namespace; unset: all namespaces (ClusterRole)")
    k.add_argument("--kube-api-url", default=_default_api_url(), help="API server URL")
    k.add_argument(
        "--kube-sa-dir", type=Path, default=SA_DIR, help="service-account token and ca.crt directory"
    )
    k.add_argument(
        "--pod-port",
        type=int,
        default=8000,
        help="metrics port when the pod has no extproc.io/metrics-port annotation",
    )
    k.add_argument(
        "--pod-kind", default="auto", help="server kind when the pod has no extproc.io/server-kind annotation"
    )
    k.add_argument("--relist-seconds", type=float, default=30.0, help="pod re-list period")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    return p


def config_from_args(args: argparse.Namespace) -> ExporterConfig:
    targets: list[Target] = [parse_target_spec(spec) for spec in args.target]
    if args.targets_file:
        targets.extend(load_targets_file(args.targets_file))
    kube = None
    if args.kube_label_selector:
        kube = KubeDiscoveryConfig(
            label_selector=args.kube_label_selector,
            node_name=args.node_name,
            api_url=args.kube_api_url,
            namespace=args.kube_namespace,
            default_port=args.pod_port,
            default_kind=None if args.pod_kind == "auto" else args.pod_kind,
            token_path=args.kube_sa_dir / "token",
            ca_path=args.kube_sa_dir / "ca.crt",
            relist_seconds=args.relist_seconds,
        )
    return ExporterConfig(
        node_name=args.node_name,
        targets=targets,
        kube=kube,
        grpc_host=args.grpc_address[0],
        grpc_port=args.grpc_address[1],
        metrics_host=args.metrics_address[0],
        metrics_port=args.metrics_address[1],
        scrape_interval=args.interval,
        scrape_timeout=args.timeout,
    )


async def run(config: ExporterConfig) -> None:
    """Run until SIGTERM/SIGINT, then shut down gracefully."""
    exporter = Exporter(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await exporter.start()
    try:
        await stop.wait()
        log.info("signal received, shutting down")
    finally:
        await exporter.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level.upper())
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        log.error("invalid configuration", extra={"error": str(exc)})
        return 2
    asyncio.run(run(config))
    return 0
