"""vLLM-like inference simulator: OpenAI API, paged KV cache, V1-style scheduling, vLLM metrics.

Programmatic use (see docs/simulator.md):

    async with running_server(SimConfig(port=0, time_scale=100)) as sim:
        ...  # sim.url, sim.engine

or `SimServer(config)` with `await start()` / `await stop()`, or `build_app(config)` for aiohttp's
test utilities. From a shell: `python -m extproc.sim --help`.

Modules, by their path from this folder: vLLM-like simulator (upstream of tests, `make run`, benchmarks):
`server.py` (start and stop it inside a running event loop), `cli.py` (`python -m extproc.sim`, a flag per
knob), `config.py` (`SimConfig`: every knob), `api.py` (the aiohttp handlers of the surface vLLM serves),
`protocol.py` (request parsing, vLLM-shaped errors, the completion-length policy), `shapes.py` (the other
APIs' requests as the simulator's `ParsedRequest`), `formats.py` (each API's answer: JSON, or SSE with usage),
`textgen.py` (text of exactly the reported token count), `engine.py` (the asyncio driver on a scaled engine
clock), `scheduler.py` (clock-free continuous batching, modelled on vLLM V1), `kvcache.py` (the paged KV block
pool), `geometry.py` (the deployment arithmetic, from `extproc/geometry/`), `metrics.py` (vLLM V1's metrics,
as it names them).
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
