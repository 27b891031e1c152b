"""Node daemons, one module per role, on the shared base in `base.py`.

This package is the only place that knows every other part of rollart.
"""

from rollart.nodes.base import NodeDaemon
from rollart.nodes.env_host import EnvHostNode
from rollart.nodes.generator import GeneratorNode
from rollart.nodes.reward_gateway import RewardGatewayNode
from rollart.nodes.trainer import TrainerNode
from rollart.topology import Role

DAEMONS: dict[Role, type[NodeDaemon]] = {
    Role.TRAINER: TrainerNode,
    Role.GENERATOR: GeneratorNode,
    Role.ENV_HOST: EnvHostNode,
    Role.REWARD_GATEWAY: RewardGatewayNode,
}

__all__ = ["DAEMONS", "EnvHostNode", "GeneratorNode", "NodeDaemon", "RewardGatewayNode", "TrainerNode"]
