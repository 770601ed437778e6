"""The simulator's deployment arithmetic lives in `extproc.geometry`, shared with `extproc plan`.

Kept as an import path so existing callers (`from extproc.sim.geometry import ...`) keep working.
"""

from extproc.geometry.deployment import (
    DEFAULT_BLOCK_SIZE,
    GIB,
    GpuDeployment,
    ModelGeometry,
    derive_num_gpu_blocks,
    kv_cache_bytes_per_gpu,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "GIB",
    "GpuDeployment",
    "ModelGeometry",
    "derive_num_gpu_blocks",
    "kv_cache_bytes_per_gpu",
]
