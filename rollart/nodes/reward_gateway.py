"""The reward gateway: Reward-as-a-Service, an elastic pool of stateless reward workers.

For now it runs the node base only: it accepts env-host sessions and answers status. The
worker pool arrives with the rollout issue.
"""

from __future__ import annotations

from rollart.nodes.base import NodeDaemon
from rollart.topology import Role


class RewardGatewayNode(NodeDaemon):
    role = Role.REWARD_GATEWAY
