"""vLLM-like inference simulator: OpenAI API, paged KV cache, V1-style scheduling, vLLM metrics.

Programmatic use (see docs/simulator.md):

    async with running_server(SimConfig(port=0, time_scale=100)) as sim:
        ...  # sim.url, sim.engine

or `SimServer(config)` with `await start()` / `await stop()`, or `build_app(config)` for aiohttp's
test utilities. From a shell: `python -m extproc.sim --help`.
"""

from extproc.geometry.deployment import GpuDeployment, ModelGeometry
from extproc.sim.api import build_app
from extproc.sim.config import SimConfig
from extproc.sim.metrics import LegacyKvMetric
from extproc.sim.scheduler import Overflow, StepTiming
from extproc.sim.server import SimServer, running_server

__all__ = [
    "GpuDeployment",
    "LegacyKvMetric",
    "ModelGeometry",
    "Overflow",
    "SimConfig",
    "SimServer",
    "StepTiming",
    "build_app",
    "running_server",
]
