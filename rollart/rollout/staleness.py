"""The staleness bound alpha: which trajectories a policy version may still train on, in one place.

Every trajectory is stamped with the policy version that *started* it (the trainer's version at its
first generation call). At version v the trainer trains only on trajectories started at v - alpha or
later; whatever started earlier is too stale wherever it is: refused or dropped by the `SampleBuffer`,
aborted on the env-host, and no generator need serve it weights older than that (a turn's
`Generate.min_version`). alpha 0 with batch barriers is the synchronous baseline.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessBound:
    """alpha (`rollout.alpha`): how many versions a trajectory's start may lag the policy it trains."""

    alpha: int

    def oldest_start(self, version: int) -> int:
        """The oldest start version admissible at policy `version` (below 0 at the first versions: all are)."""
        return version - self.alpha

    def admits(self, started_at: int, version: int) -> bool:
        """Whether a trajectory started at `started_at` may still be trained at policy `version`."""
        return started_at >= self.oldest_start(version)

    def oldest_weights(self, version: int) -> int:
        """The oldest weight version a generator may serve a turn with at policy `version` (never below 0)."""
        return max(0, self.oldest_start(version))
