"""What a weight push says on the wire, and the errors a bad push raises.

A push runs over a bulk connection (TCP: `rollart.protocol.bulk.open_bulk`; UCX:
`rollart.weights.ucx.open_ucx`), both after the same HMAC handshake. Then:

    receiver -> sender      Holding(version)                      the version it has applied
    sender -> receiver      Push(version, count, ..., relay)      a version starts; `relay`: pass it on
    sender -> receiver      BucketManifest, bulk frame (payload)  once per bucket, index 0..count-1
    receiver -> sender      VersionAck(version, holding, error)   after the last bucket is applied
    receiver -> sender      VersionAck(..., node=N), RelayFailed  about the hops after it, passed back

With `transport: nccl` the Push names a collective group (`Push.group`), every receiver of the push gets its own
connection and manifests, and each payload comes to all of them at once by broadcast over the group instead of
as a bulk frame (`rollart.weights.collective`); nothing is relayed.

The sender is the trainer, or a generator relaying: it forwards each bucket to the first hop of
`relay` as soon as it has the bucket, announcing the rest of the chain, and passes the acks of every
hop behind it back up, so the trainer learns what each generator holds over its one connection.

Schema evolution as in `rollart.protocol.messages`: new fields get defaults and go at the end.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from rollart.errors import RollartError
from rollart.protocol.errors import ProtocolError
from rollart.protocol.messages import WIRE as _WIRE
from rollart.protocol.messages import Channel


class TensorEntry(msgspec.Struct, **_WIRE):
    """Where one tensor lies in its bucket's payload."""

    name: str
    """Hugging Face parameter name, as `state_dict()` gives it."""
    dtype: str
    """torch dtype without the `torch.` prefix: `float32`, `bfloat16`, `int64`, ..."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the payload (a multiple of `buckets.ALIGN`)."""
    nbytes: int


class BucketManifest(msgspec.Struct, tag="bucket", **_WIRE):
    """Announces one bucket of one version; its payload follows as one bulk frame."""

    version: int
    index: int
    count: int
    """How many buckets this version has."""
    nbytes: int
    """Payload size in bytes."""
    crc32c: int
    """CRC-32C of the whole payload (`buckets.checksum`), computed by the trainer and checked at every hop."""
    tensors: tuple[TensorEntry, ...]
    delta_nbytes: int = 0
    """0: the payload is the bucket's bytes. Else the payload is `delta_nbytes` bytes: the bucket's
    bytes XOR the same bucket of the push's `base` version, byte-shuffled by `delta_stride` and
    compressed with zstd (`rollart.weights.delta`); `nbytes` and `crc32c` are those of the decoded bytes."""
    delta_stride: int = 1
    """The element size the XOR was byte-shuffled by before compression (1: not shuffled)."""
    mac: bytes = b""
    """HMAC-SHA256 of everything above, keyed with the run's secret (`manifest_mac`): set by the trainer, checked by
    every receiver that knows the secret (required when the payload comes by a group, outside the authenticated
    connection); empty from a sender that predates it."""


class Hop(msgspec.Struct, **_WIRE):
    """A generator further down a relay chain, and where its weights go."""

    name: str
    host: str
    port: int
    """Its session port (TCP bulk connections)."""
    ucx_port: int = 0
    """Its UCX receiver's port; 0: TCP."""


class GroupTicket(msgspec.Struct, **_WIRE):
    """Where a push's collective group meets and the receiver's place in it (`rollart.weights.collective`)."""

    key: str
    """Random per group: its members' rendezvous prefix in the store."""
    host: str
    port: int
    """The trainer's TCPStore."""
    rank: int
    size: int
    backend: str
    """nccl or gloo: every member uses the same."""
    timeout_s: float
    """How long joining or one broadcast may take before the group counts as broken."""


class Push(msgspec.Struct, tag="push", **_WIRE):
    """Sender -> receiver: a version begins; its `count` buckets follow."""

    version: int
    count: int
    nbytes: int
    """Bytes of all its payloads: what progress is measured against."""
    dtype: str = ""
    """The dtype floating-point tensors travel in; empty: each as the trainer holds it."""
    tied: tuple[tuple[str, str], ...] = ()
    """(alias, name): the alias is the same tensor as `name` (tied embeddings travel once)."""
    relay: tuple[Hop, ...] = ()
    """Pass the version on to `relay[0]`, telling it to pass it on to the rest."""
    base: int = -1
    """Buckets sent as deltas (`BucketManifest.delta_nbytes`) are against this version's bytes, which
    every receiver of the push keeps (`Holding.base`); -1: every bucket is whole."""
    group: GroupTicket | None = None
    """Set: every payload of this push comes by broadcast over this group, not as a bulk frame after its
    manifest (`transport: nccl`)."""


class Holding(msgspec.Struct, tag="holding", **_WIRE):
    """Receiver -> publisher, first thing on a connection: the version it has applied."""

    version: int
    base: int = -1
    """The version whose bytes it keeps to decode deltas against (-1: none kept)."""


class VersionAck(msgspec.Struct, tag="ack", **_WIRE):
    """Receiver -> publisher: the whole of `version` arrived; `holding` is what is applied now."""

    version: int
    holding: int
    error: str = ""
    """Set when `apply` failed: the version arrived intact but the engine refused it."""
    node: str = ""
    """Whose ack this is, when passed back by a relay; empty: the receiver's own."""
    base: int = -1
    """The version whose bytes it keeps now to decode deltas against (-1: none kept)."""


class RelayFailed(msgspec.Struct, tag="relay-failed", **_WIRE):
    """Relay -> sender: `version` could not be passed on to `node` (it failed: `error`), so the hops
    after it (`unreached`) did not get it from here either."""

    version: int
    node: str
    error: str
    unreached: tuple[str, ...] = ()


WeightMsg = BucketManifest | Holding | VersionAck | Push | RelayFailed
WEIGHTS: Channel[WeightMsg] = Channel("weights", WeightMsg)


def manifest_mac(secret: bytes, manifest: BucketManifest) -> bytes:
    """The keyed checksum of a bucket's manifest (its `mac` left out): with the manifest's CRC-32C of the payload,
    what ties a bucket's bytes to the trainer that announced them."""
    unsigned = msgspec.structs.replace(manifest, mac=b"")
    return hmac.new(secret, WEIGHTS.encode(unsigned), hashlib.sha256).digest()


class WeightFormatError(ProtocolError):
    """A bucket whose manifest does not fit its payload (dtype, shape, offset or size)."""


class ChecksumMismatch(WeightFormatError):
    """A bucket's payload does not match the checksum its manifest announced."""


class ManifestForged(WeightFormatError):
    """A bucket's manifest does not carry the MAC the run's secret gives it (or carries none where one is needed)."""


class DeltaBaseMissing(WeightFormatError):
    """A delta arrived against a version whose bytes this receiver does not keep."""


class MissingBucket(WeightFormatError):
    """A version ended (its last bucket arrived) without some of its buckets."""


class TransportUnavailable(RollartError):
    """The UCX transport was asked for but `ucxx` cannot be imported here; the message says why."""
