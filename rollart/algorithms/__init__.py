"""RL algorithms as pure torch code over plain data: no network, no nodes, no engines.

`grpo` holds GRPO for asynchronous rollouts: group advantages, packing trajectories into padded
tensors, per-token log-probs from a causal LM's logits, and the decoupled PPO loss with a truncated
behaviour importance weight. The trainer node feeds it finished groups and a model; nothing here
knows where they came from. Importing this package pulls in no torch; importing `grpo` does.
"""
