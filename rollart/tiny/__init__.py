"""The default run's model: a tiny Qwen3 with a character tokenizer, built locally and saved in Hugging
Face format (`model`), and its format warm-up on random valid episodes (`warmup`). A recipe over
models, envs and rollout, not an engine: nothing in `training/` or `generation/` imports it."""
