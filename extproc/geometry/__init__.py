"""Deployment geometry shared by the simulator and the planner: model shapes, memory and KV capacity.

- `deployment`: the block arithmetic (`ModelGeometry`, `GpuDeployment`, `derive_num_gpu_blocks`) the
  simulator sizes its cache with;
- `model`: a model's shape and parameter count from a Hugging Face config.json;
- `presets`: built-in models and GPUs with the sources their values were checked against;
- `capacity`: vLLM's memory model for a tensor/pipeline-parallel replica.

Modules, by their path from this folder: deployment geometry shared by the simulator and the planner:
`model.py` (a model's shape from its `config.json`: parameter counts, KV per token), `deployment.py` (vLLM's
KV memory model: the KV blocks a model gets on a GPU), `capacity.py` (a whole deployment's KV capacity, tensor
and pipeline parallel), `presets.py` (built-in models and GPUs).
"""
