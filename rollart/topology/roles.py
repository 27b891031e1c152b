"""What a node does in a run (`Role`), and the session name of a shared reward gateway: the names every part
of the topology, and the nodes, use for them."""

from __future__ import annotations

import enum

REWARD_SERVICE = "reward-service"
"""The session name of the shared reward gateway an env-host uses (`run.reward_service`)."""


class Role(enum.Enum):
    """What a node does in the run; one daemon module per role."""

    TRAINER = "trainer"
    GENERATOR = "generator"
    ENV_HOST = "env-host"
    REWARD_GATEWAY = "reward-gateway"
