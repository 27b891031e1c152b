"""Node daemons, one module per role, on the shared base in `base.py`.

This package is the only place that knows every other part of rollart.
"""

from rollart.nodes.base import NodeDaemon
from rollart.nodes.env_host import EnvHostNode
from rollart.nodes.generator import GeneratorNode
from rollart.nodes.reward_gateway import RewardGatewayNode
from rollart.nodes.trainer import TrainerNode
from rollart.nodes.trainer_member import TrainerMemberNode
from rollart.topology import NodeSpec
from rollart.topology.roles import Role

DAEMONS: dict[Role, type[NodeDaemon]] = {
    Role.TRAINER: TrainerNode,
    Role.GENERATOR: GeneratorNode,
    Role.ENV_HOST: EnvHostNode,
    Role.REWARD_GATEWAY: RewardGatewayNode,
}


def daemon_for(spec: NodeSpec) -> type[NodeDaemon]:
    """The daemon that runs node `spec`: its role's, or for a member of a trainer group (a trainer
    with `primary:`), the one that only runs its ranks."""
    return TrainerMemberNode if spec.primary is not None else DAEMONS[spec.role]


__all__ = [
    "DAEMONS",
    "EnvHostNode",
    "GeneratorNode",
    "NodeDaemon",
    "RewardGatewayNode",
    "TrainerMemberNode",
    "TrainerNode",
    "daemon_for",
]
