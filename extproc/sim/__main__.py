"""`python -m extproc.sim`: run the inference simulator (see extproc/sim/cli.py and docs/simulator.md)."""

import sys

from extproc.sim.cli import main

sys.exit(main())
