"""The GRPO settings, torch-free so that the topology can carry them (see `grpo.py` for the loss)."""

from __future__ import annotations

import msgspec


class GRPOConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How the trainer turns a batch of groups into a loss."""

    clip_eps: float = 0.2
    """PPO clip on r = pi_theta / pi_prox: r is kept at 1 - clip_eps or above."""
    clip_eps_high: float | None = None
    """r is kept at 1 + clip_eps_high or below (DAPO's clip-higher: > clip_eps lets rare tokens grow);
    None: clip_eps."""
    tis_cap: float = 2.0
    """Truncation C of the behaviour importance weight pi_prox / mu."""
    kl_coef: float = 0.0
    """Weight of the k3 estimator of KL(pi_theta || pi_ref); 0 disables it (no reference model)."""
    anchor_coef: float = 0.0
    """Weight of k3 KL(pi_theta || pi_prox) on every generated token of the batch, groups without
    signal included (the learner keeps up to `anchor_groups` of them when this is > 0): within a
    step's epochs it pulls back what the other groups' updates move, so a task already solved (all
    its groups without signal) does not drift while another learns in the same weights. 0: off."""
    anchor_groups: int = 2
    """Groups without signal kept in each batch for the anchor, drawn at random (they cost
    training time and carry no policy gradient)."""
    normalize_std: bool = True
    """Divide group advantages by the group's std (Dr. GRPO: False; the division up-weights prompts
    that are almost always or almost never solved)."""
    adv_eps: float = 1e-6
    """Added to the group std before dividing."""

    @property
    def clip_high(self) -> float:
        """The upper clip distance actually used."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for values that are well-typed but unusable."""
        problems: list[tuple[str, str]] = []
        if not 0 < self.clip_eps < 1:
            problems.append(("clip_eps", f"expected a value in (0, 1); got {self.clip_eps}"))
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            problems.append(("clip_eps_high", f"expected a value > 0 or null; got {self.clip_eps_high}"))
        if self.tis_cap < 1:  # a cap below 1 would down-weight even on-policy tokens
            problems.append(("tis_cap", f"expected a value >= 1; got {self.tis_cap}"))
        for key in ("kl_coef", "anchor_coef", "anchor_groups"):
            if getattr(self, key) < 0:
                problems.append((key, f"expected a value >= 0; got {getattr(self, key)}"))
        if self.adv_eps <= 0:
            problems.append(("adv_eps", f"expected a value > 0; got {self.adv_eps}"))
        return problems
