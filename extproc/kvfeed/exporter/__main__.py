"""`python -m extproc.kvfeed.exporter`: the KV-cache feed exporter (see extproc.kvfeed.exporter.cli)."""

from __future__ import annotations

import sys

from extproc.kvfeed.exporter.cli import main

if __name__ == "__main__":
    sys.exit(main())
