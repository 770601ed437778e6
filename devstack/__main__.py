"""`python -m devstack [--config PATH] [--profile lean|inline] [--upstream URL]`: the local stack in the
foreground (`make run`, `make run UPSTREAM=URL`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devstack.run import run_stack
from extproc.envoyconf.profiles import DEFAULT_PROFILE, PROFILES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devstack", description="run simulator + sidecar + Envoy on localhost (make run)"
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="sidecar config (default: config/local.yaml)"
    )
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default=DEFAULT_PROFILE,
        help=f"how Envoy and the sidecar split the work (default: {DEFAULT_PROFILE}; docs/architecture.md)",
    )
    parser.add_argument(
        "--upstream",
        metavar="URL",
        default=None,
        help="an OpenAI-compatible server of your own (http://HOST:PORT, vLLM or SGLang) instead of the "
        "simulator: its model and window from /v1/models, its KV cache from /metrics (make run UPSTREAM=URL)",
    )
    args = parser.parse_args(argv)
    return run_stack(args.config, args.profile, args.upstream)


if __name__ == "__main__":
    sys.exit(main())
