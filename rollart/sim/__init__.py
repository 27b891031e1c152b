"""Simulation mode: engines, environments, training and links whose timing comes from models.

The nodes and the scheduling code are the real ones; only the parts that would need GPUs or a
cluster are replaced: `hardware` (GPU and model presets, the roofline cost model), `engine` (a
continuous-batching generation engine), `reward` (a reward model's service time). Simulated seconds
come from `rollart.clock`, which real code uses too; the in-process runner is `rollart.launch.inprocess`.
"""
