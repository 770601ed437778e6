"""Deployment geometry shared by the simulator and the planner: model shapes, memory and KV capacity.

- `deployment`: the block arithmetic (`ModelGeometry`, `GpuDeployment`, `derive_num_gpu_blocks`) the
  simulator sizes its cache with;
- `model`: a model's shape and parameter count from a Hugging Face config.json;
- `presets`: built-in models and GPUs with the sources their values were checked against;
- `capacity`: vLLM's memory model for a tensor/pipeline-parallel replica.
"""
