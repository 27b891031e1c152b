"""RL algorithms as pure torch code over plain data: no network, no nodes, no engines.

`grpo` holds GRPO for asynchronous rollouts: group advantages, packing trajectories into padded
tensors, per-token log-probs from a causal LM's logits, and the decoupled PPO loss with a truncated
behaviour importance weight; `selection` decides which groups of a batch are trained on (the
has-signal rule the SampleBuffer shares, and the anchor groups). The trainer node feeds them
finished groups and a model; nothing here knows where they came from. Importing this package
pulls in no torch; importing `grpo` does.
"""
