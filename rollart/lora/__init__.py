"""LoRA, shared by training and generation: the settings (`spec`) and PEFT's adapter format over tensors
(`adapters`: putting adapters on a model, their names, merging them into base weights, adapter folders).

Both sides import it; it imports neither.
"""
