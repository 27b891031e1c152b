"""Simulation mode: engines, environments, training and links whose timing comes from models.

The nodes and the scheduling code are the real ones; only the parts that would need GPUs or a
cluster are replaced: `hardware` (GPU and model presets, the roofline cost model), `clock`
(simulated seconds, faster than real time), `engine` (a continuous-batching generation engine).
"""
