"""Command line: `extproc serve --config PATH` runs the sidecar; `extproc check-config PATH` validates;
`extproc envoy-config` prints a profile's Envoy config; `extproc envoy-upstream URL` prints the file the
Kubernetes gateway loads its engine from (k8s/README.md); `extproc plan` sizes a deployment and suggests its
limits (docs/planning.md). The local stack (`make run`) is `python -m devstack`, outside this package."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from extproc.config import Config, ConfigError, config_warnings, load_config
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


def check_config(path: Path) -> int:
    """Validate a file the way the sidecar loads it: every problem, one per line (exit 1); warnings about
    settings that work against each other do not fail it."""
    try:
        config = load_config(path)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"invalid config: {problem}", file=sys.stderr)
        return 1
    for warning in config_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    print("config ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the ext_proc sidecar")
    serve.add_argument("--config", required=True, type=Path, help="YAML config file (the ConfigMap)")
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("config", type=Path)
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
        return check_config(args.config)
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
