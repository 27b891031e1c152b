"""Weight sync, trainer -> generators: bucketed snapshots pushed in the background, newest version wins.

- `buckets`: a state dict cut into ~64 MiB payloads with manifests and CRC-32s, and back without a copy;
- `publisher`: `WeightPublisher`, the trainer's end (snapshot, then one push task per generator);
- `receiver`: `WeightReceiver`, the generator's end (`on_bulk` for TCP, `listen_ucx` for UCX);
- `ucx`: the same frames over ucxx endpoints; `wire`: the messages and errors.

See docs/weights.md for the wire format and how to choose a transport.
"""

from rollart.weights.buckets import DEFAULT_BUCKET_BYTES, plan_buckets, unpack_bucket
from rollart.weights.publisher import Transport, WeightPublisher
from rollart.weights.receiver import ApplyWeights, ReceiverStats, WeightReceiver
from rollart.weights.targets import TargetStats
from rollart.weights.ucx import ucx_unavailable
from rollart.weights.wire import ChecksumMismatch, MissingBucket, TransportUnavailable, WeightFormatError

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ApplyWeights",
    "ChecksumMismatch",
    "MissingBucket",
    "ReceiverStats",
    "TargetStats",
    "Transport",
    "TransportUnavailable",
    "WeightFormatError",
    "WeightPublisher",
    "WeightReceiver",
    "plan_buckets",
    "ucx_unavailable",
    "unpack_bucket",
]
