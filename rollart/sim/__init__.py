"""Simulation mode: environments, training, links and reward service whose timing comes from models.

The nodes and the scheduling code are the real ones; only the parts that would need GPUs or a
cluster are replaced: `hardware` (GPU and model presets, the roofline cost model), `config` (`run.sim`),
`weight_sync` (a weight push's timing), `reward` (a reward model's service time). The simulated generation
engine is a generation backend like the others (`rollart.generation.sim`), timed by `hardware`. Simulated
seconds come from `rollart.clock`, which real code uses too; the in-process runner is `rollart.launch.inprocess`.
"""
