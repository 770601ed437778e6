"""Command line: `extproc serve --config PATH` runs the sidecar; `extproc check-config PATH` validates;
`extproc plan` sizes a deployment and suggests its limits (docs/planning.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from extproc.config import ConfigError, load_config
from extproc.logs import setup_logging
from extproc.plan.cli import add_plan_parser, run_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="extproc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the ext_proc sidecar")
    serve.add_argument("--config", required=True, type=Path, help="YAML config file (the ConfigMap)")
    check = sub.add_parser("check-config", help="validate a config file and exit")
    check.add_argument("config", type=Path)
    stack = sub.add_parser("stack", help="run simulator + sidecar + Envoy on localhost (make run)")
    stack.add_argument(
        "--config", type=Path, default=None, help="sidecar config (default: config/local.yaml)"
    )
    add_plan_parser(sub)
    args = parser.parse_args(argv)

    if args.command == "plan":
        return run_plan(args)

    if args.command == "check-config":
        try:
            load_config(args.config)
        except ConfigError as exc:
            print(f"invalid config: {exc}", file=sys.stderr)
            return 1
        print("config ok")
        return 0
    if args.command == "stack":
        from extproc.stack import run_stack

        return run_stack(args.config)

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
