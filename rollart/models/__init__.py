"""Model folders without loading them: what a checkpoint is (shape, dtype, stop tokens), the public shapes of the
Qwen3 family for sizing a topology before the weights are there, and the recipe of the BPE test model.

Nothing here imports torch at module level, so the topology, the launcher and `rollart check` use it freely;
the test model's builder (`qwen3_bpe.py`) imports torch and transformers inside its functions.
"""
