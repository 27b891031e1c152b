"""Typed settings of the wire: framing limits and session timing.

Embedded in the topology's `run.session` section; every field has a default that suits a
one-machine run, and `validate()` checks what msgspec's types cannot.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 2
"""Bumped on any change to the handshake or session frames that an older peer cannot read. 2: the handshake's
proofs cover every field of every handshake frame (1 covered the nonces and identities alone)."""


class SessionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """How persistent sessions frame, buffer, detect silence and reconnect."""

    max_frame_bytes: int = 16 * 1024 * 1024
    """Largest message frame accepted; a bigger header is refused before its body is read."""
    max_bulk_bytes: int = 64 * 1024**3
    """Largest bulk payload (weights) accepted on a bulk connection."""
    resend_buffer: int = 4096
    """Unacknowledged outgoing messages kept for resending; a sender waits when it is full."""
    heartbeat_interval_s: float = 1.0
    """How often each side sends a heartbeat."""
    heartbeat_deadline_s: float = 5.0
    """A peer heard nothing from for this long is taken as gone and the connection is dropped."""
    handshake_timeout_s: float = 5.0
    """A connection that has not finished the handshake by then is closed."""
    backoff_base_s: float = 0.05
    """First reconnect delay bound; it doubles each failed attempt (full jitter)."""
    backoff_cap_s: float = 5.0
    """Largest reconnect delay bound."""
    give_up_after_s: float = 300.0
    """A client that could not reconnect for this long fails its session and pending requests."""
    linger_s: float = 600.0
    """How long a server keeps a disconnected session's state for the client to resume it."""
    default_request_timeout_s: float = 30.0
    """Deadline of a request that does not set its own (also an env-host's hand-in of a group)."""
    long_poll_slack_s: float = 15.0
    """Added to a long-poll request's own wait (`TaskWanted.wait_s`) for its deadline."""
    probe_timeout_s: float = 10.0
    """Deadline of a request to a peer that may still be starting (the trainer's `WeightsWhere`)."""
    retry_base_s: float = 1.0
    """First delay bound before a remote call retried outside the session is tried again; it doubles."""
    retry_cap_s: float = 10.0
    """Largest delay bound between such tries (`rollart.protocol.retry`)."""
    retry_deadline_s: float = 300.0
    """Such a call gives up (`RetriesExhausted`) once it has been tried for this long."""

    def validate(self) -> list[tuple[str, str]]:
        """Return (field, problem) pairs for values that are well-typed but unusable."""
        problems: list[tuple[str, str]] = []
        positive = [
            "max_frame_bytes",
            "max_bulk_bytes",
            "resend_buffer",
            "heartbeat_interval_s",
            "heartbeat_deadline_s",
            "handshake_timeout_s",
            "backoff_base_s",
            "backoff_cap_s",
            "give_up_after_s",
            "linger_s",
            "default_request_timeout_s",
            "long_poll_slack_s",
            "probe_timeout_s",
            "retry_base_s",
            "retry_cap_s",
            "retry_deadline_s",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                problems.append((name, f"expected a value > 0; got {getattr(self, name)!r}"))
        if self.max_frame_bytes > 2**31:
            problems.append(("max_frame_bytes", f"expected at most 2**31; got {self.max_frame_bytes}"))
        if self.heartbeat_deadline_s <= self.heartbeat_interval_s:
            problems.append(
                (
                    "heartbeat_deadline_s",
                    f"expected more than heartbeat_interval_s ({self.heartbeat_interval_s}); "
                    f"got {self.heartbeat_deadline_s}",
                )
            )
        if self.backoff_cap_s < self.backoff_base_s:
            problems.append(
                ("backoff_cap_s", f"expected at least backoff_base_s ({self.backoff_base_s}); got {self.backoff_cap_s}")
            )
        if self.retry_cap_s < self.retry_base_s:
            problems.append(
                ("retry_cap_s", f"expected at least retry_base_s ({self.retry_base_s}); got {self.retry_cap_s}")
            )
        return problems
