"""The trainer node: owns the policy, its version, the SampleBuffer and the task dispenser.

For now it runs the node base only: it accepts env-host sessions, connects to every generator
(the weight-push path), and answers status. Training arrives with the trainer issue.
"""

from __future__ import annotations

from rollart.nodes.base import NodeDaemon
from rollart.topology import Role


class TrainerNode(NodeDaemon):
    role = Role.TRAINER
