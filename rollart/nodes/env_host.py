"""The env-host node: runs environments and one coroutine per trajectory.

For now it runs the node base only: it opens sessions to the trainer, every generator and the
reward gateway, and polls their status. Trajectories arrive with the rollout issue.
"""

from __future__ import annotations

from rollart.nodes.base import NodeDaemon
from rollart.topology import Role


class EnvHostNode(NodeDaemon):
    role = Role.ENV_HOST
