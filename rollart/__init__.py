"""RollArt: agentic RL training on disaggregated infrastructure.

Nodes of four roles (trainer, generator, env-host, reward-gateway) run as one asyncio daemon
each and talk over persistent sessions (`rollart.protocol`). See README.md to run it.
"""

__version__ = "0.1.0"
