"""The generator node: an inference engine of one hardware class, serving generation requests.

For now it runs the node base only: it accepts sessions from env-hosts and the trainer and
answers status and echo. Engines arrive with the rollout issue.
"""

from __future__ import annotations

from rollart.nodes.base import NodeDaemon
from rollart.topology import Role


class GeneratorNode(NodeDaemon):
    role = Role.GENERATOR
