"""What a weight push says on the wire, and the errors a bad push raises.

A push runs over a bulk connection (TCP: `rollart.protocol.bulk.open_bulk`; UCX:
`rollart.weights.ucx.open_ucx`), both after the same HMAC handshake. Then:

    receiver -> publisher   Holding(version)                     the version it has applied
    publisher -> receiver   BucketManifest, bulk frame (payload)  once per bucket, index 0..count-1
    receiver -> publisher   VersionAck(version, holding, error)   after the last bucket

Schema evolution as in `rollart.protocol.messages`: new fields get defaults and go at the end.
"""

from __future__ import annotations

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
    crc32: int
    """`zlib.crc32` of the whole payload."""
    tensors: tuple[TensorEntry, ...]


class Holding(msgspec.Struct, tag="holding", **_WIRE):
    """Receiver -> publisher, first thing on a connection: the version it has applied."""

    version: int


class VersionAck(msgspec.Struct, tag="ack", **_WIRE):
    """Receiver -> publisher: the whole of `version` arrived; `holding` is what is applied now."""

    version: int
    holding: int
    error: str = ""
    """Set when `apply` failed: the version arrived intact but the engine refused it."""


WeightMsg = BucketManifest | Holding | VersionAck
WEIGHTS: Channel[WeightMsg] = Channel("weights", WeightMsg)


class WeightFormatError(ProtocolError):
    """A bucket whose manifest does not fit its payload (dtype, shape, offset or size)."""


class ChecksumMismatch(WeightFormatError):
    """A bucket's payload does not match the checksum its manifest announced."""


class MissingBucket(WeightFormatError):
    """A version ended (its last bucket arrived) without some of its buckets."""


class TransportUnavailable(RollartError):
    """The UCX transport was asked for but `ucxx` cannot be imported here; the message says why."""
