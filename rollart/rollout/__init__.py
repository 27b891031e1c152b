"""Trajectory-level rollout: the trajectory coroutine, LLMProxy, SampleBuffer and dispenser.

This package talks to other nodes only through protocol sessions and imports no engine, so the
same code runs against real, simulated and fake generators. Importing it pulls in no torch.
"""
