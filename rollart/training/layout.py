"""What a training checkpoint folder holds, by name: the files each backend writes and `rollart export` reads.

Every checkpoint folder also holds the model's `config.json` and tokenizer files, and the trainer node adds its
own state beside them (`rollart.rundir.RunDir.trainer_state`). By backend:

- torch: a Hugging Face model folder (safetensors) with `OPTIMIZER_FILE` and, under LoRA, `ENGINE_FILE`;
- fsdp2: `DCP_FOLDER` (the `torch.distributed.checkpoint` shards of `{"model": ..., "optim": ...}`, whose
  policy weights are the `MODEL_PREFIX` entries) and `ENGINE_FILE`;
- megatron: a Hugging Face model folder, `MEGATRON_OPTIM_FOLDER` (one optimizer file per tensor and pipeline
  rank) and `ENGINE_FILE`.
"""

ENGINE_FILE = "engine.json"
"""The engine's step count, rank layout and LoRA settings."""
OPTIMIZER_FILE = "optimizer.pt"
"""The torch backend's optimizer state and step count."""
DCP_FOLDER = "dcp"
"""The fsdp2 backend's shard folder."""
DCP_METADATA = ".metadata"
"""Written last by `torch.distributed.checkpoint`: the shards are whole once it is there."""
MODEL_PREFIX = "model.lm."
"""The policy's weights among the fsdp2 shards' entries: `model` (the state dict), `lm` (the wrapped LM)."""
MEGATRON_OPTIM_FOLDER = "megatron_optim"
"""The megatron backend's optimizer shards."""
