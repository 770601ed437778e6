"""Step timing of a planned deployment, scaled from the simulator's calibrated Llama-3-8B / H100 model.

The simulator's `StepTiming` defaults come from three assumptions (docs/simulator.md): a decode step reads
every weight once from HBM plus ~1.7 ms of launch and sampling overhead (6.5 ms for 16 GB at 3.35 TB/s);
each running sequence adds attention reads in proportion to its KV bytes (0.1 ms at Llama-3-8B's
128 KiB/token); a prompt token costs 2 x active parameters FLOPs at ~40 % of dense bf16 peak. The planner
applies the same three rules to another model and GPU, so Llama-3-8B on an H100 gives exactly the
simulator's defaults and everything else is scaled from them. These are estimates, not measurements.
"""

from __future__ import annotations

import math

from extproc.geometry.capacity import Capacity
from extproc.geometry.deployment import GIB
from extproc.geometry.presets import GpuSpec
from extproc.sim.scheduler import StepTiming

STEP_OVERHEAD_S = 0.0017
"""Kernel launch and sampling time of a decode step beyond reading the weights."""

PREFILL_MFU = 0.4
"""Fraction of dense bf16 peak a prefill reaches."""

REFERENCE_KV_BYTES = 131_072
"""Llama-3-8B's KV bytes per token, at which the per-sequence step cost is 0.1 ms."""

REFERENCE_PER_SEQ_S = 0.0001


def _round_to(value: float, quantum: float) -> float:
    """Round half up to a multiple of `quantum` (the simulator's flags are given to that precision)."""
    return math.floor(value / quantum + 0.5) * quantum


def timing_for(capacity: Capacity, gpu: GpuSpec) -> StepTiming:
    """The simulator's step model for this deployment (per pipeline, all stages in sequence)."""
    tp = capacity.deployment.tensor_parallel
    weight_bytes = sum(s.weights_gib for s in capacity.stages) * GIB / tp
    base = STEP_OVERHEAD_S + weight_bytes / (gpu.hbm_tb_per_s * 1e12)
    kv_bytes = sum(s.kv_bytes_per_token_per_gpu for s in capacity.stages)
    per_seq = REFERENCE_PER_SEQ_S * kv_bytes / REFERENCE_KV_BYTES
    flops = 2 * capacity.model.active_param_count() / tp
    prefill = flops / (PREFILL_MFU * gpu.bf16_dense_tflops * 1e12)
    return StepTiming(
        base_s=round(_round_to(base, 1e-4), 6),
        per_seq_s=round(_round_to(per_seq, 1e-6), 9),
        per_prefill_token_s=round(_round_to(prefill, 1e-5), 8),
    )


def requests_per_second(timing: StepTiming, concurrency: int, prompt: float, output: float) -> float:
    """Sustained completion rate with `concurrency` sequences running.

    Per second the engine spends `d` decode steps of `step(N)` and prefills `r x prompt` tokens:
    d x step(N) + r x prompt x per_prefill_token = 1, with r x output = N x d tokens generated, so
    r = 1 / (output x step(N) / N + prompt x per_prefill_token).
    """
    n = max(1, concurrency)
    step = timing.base_s + timing.per_seq_s * n
    return 1.0 / (output * step / n + prompt * timing.per_prefill_token_s)
