"""Command line: `extproc serve --config PATH` runs the sidecar; `extproc check-config PATH` validates (for N
sidecar replicas with `--replicas N`; `--strict` fails on warnings too); `extproc envoy-config` prints a
profile's Envoy config; `extproc envoy-upstream URL` prints the file the Kubernetes gateway loads its engine
from (k8s/README.md); `extproc plan` sizes a deployment and suggests its limits (docs/planning.md). The local
stack (`make run`) is `python -m devstack`, outside this package."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from extproc.config import Config, ConfigError, config_warnings, load_config
from extproc.config.warnings import replica_problems, replica_warnings
from extproc.envoyconf.profiles import ENVOY_TEMPLATE, PROFILES, REPO
from extproc.logs import setup_logging
from extproc.plan.cli import add_plan_parser, run_plan


def print_envoy_config(profile: str, template: Path | None, config_path: Path | None) -> int:
    """Print a profile's Envoy config: the template itself (inline), or the lean rendering of it."""
    from extproc.envoyconf.lean import HEADER, ISTIO_NOTE, render_envoy_yaml

    source = template or ENVOY_TEMPLATE
    try:
        sidecar = load_config(config_path) if config_path is not None else Config()
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    if profile == "inline":
        sys.stdout.write(source.read_text())
        return 0
    given = (("template", template), ("config", config_path))
    args = "".join(f" --{name} {value}" for name, value in given if value is not None)
    shown = source.resolve().relative_to(REPO) if source.resolve().is_relative_to(REPO) else source
    rendered = render_envoy_yaml(source, sidecar)
    note = ISTIO_NOTE if rendered.startswith("apiVersion: networking.istio.io") else ""
    sys.stdout.write(HEADER.format(args=args, source=shown) + note + rendered)
    return 0


def print_envoy_upstream(url: str, sni: str | None, ca: str | None) -> int:
    """Print the CDS file of the engine at `url` (extproc/envoyconf/upstream.py)."""
    from extproc.envoyconf.upstream import UpstreamURLError, render_upstream_yaml

    try:
        sys.stdout.write(render_upstream_yaml(url, sni, ca))
    except UpstreamURLError as exc:
        print(f"envoy-upstream: {exc}", file=sys.stderr)
        return 2
    return 0


def replica_count(text: str) -> int:
    """`--replicas`: how many sidecar replicas will run the file, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of replicas, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def check_config(path: Path, replicas: int = 1, strict: bool = False) -> int:
    """Validate a file the way the sidecar loads it, for `replicas` sidecar replicas: every problem, one per
    line (exit 1), a config N replicas would enforce N times over among them; warnings about settings that
    work against each other follow, and fail it only under `strict` (a CI gate, where a warning such as
    limits under a misspelt model name must not pass as `config ok`)."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"invalid config: {problem}", file=sys.stderr)
        return 1
    problems = replica_problems(config, replicas)
    warnings = config_warnings(config) + replica_warnings(config, replicas)
    for problem in problems:
        print(f"invalid config: {problem}", file=sys.stderr)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if problems:
        return 1
    if strict and warnings:
        print(f"check-config --strict: {len(warnings)} warning(s), counted as errors", file=sys.stderr)
        return 1
    print("config ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the ext_proc sidecar")
    serve.add_argument("--config", required=True, type=Path, help="YAML config file (the ConfigMap)")
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("config", type=Path)
    check.add_argument(
        "--replicas",
        type=replica_count,
        default=1,
        help="sidecar replicas that will run it: above 1, refuse a config whose limits are not shared "
        "through a store (each replica would enforce all of them) (default: 1)",
    )
    check.add_argument("--strict", action="store_true", help="exit 1 on any warning too")
    render = sub.add_parser("envoy-config", help="print the Envoy config of a profile (lean: rendered)")
    render.add_argument("--profile", choices=PROFILES, default="lean")
    render.add_argument(
        "--template", type=Path, default=None, help="inline Envoy config (default: envoy/envoy.yaml)"
    )
    render.add_argument(
        "--config", type=Path, default=None, help="sidecar config: its path table and body cap"
    )
    upstream = sub.add_parser(
        "envoy-upstream", help="print the file the Kubernetes gateway loads its engine (llm_upstream) from"
    )
    upstream.add_argument("url", help="the engine's root: http://HOST:PORT or https://HOST:PORT")
    upstream.add_argument(
        "--sni", default=None, help="https: the name in the engine's certificate (default HOST)"
    )
    upstream.add_argument(
        "--ca",
        default=None,
        help="https: the CA file in the Envoy container (default /etc/envoy-upstream/ca.crt)",
    )
    add_plan_parser(sub)
    args = parser.parse_args(argv)

    if args.command == "plan":
        return run_plan(args)

    if args.command == "check-config":
        return check_config(args.config, args.replicas, args.strict)
    if args.command == "envoy-config":
        return print_envoy_config(args.profile, args.template, args.config)
    if args.command == "envoy-upstream":
        return print_envoy_upstream(args.url, args.sni, args.ca)

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    from extproc.app import serve as serve_forever

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_forever(args.config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
