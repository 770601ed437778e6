"""`python -m extproc.exporter`: the KV-cache feed exporter (see extproc.exporter.cli)."""

from __future__ import annotations

import sys

from extproc.exporter.cli import main

if __name__ == "__main__":
    sys.exit(main())
