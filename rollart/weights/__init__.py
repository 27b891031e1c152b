"""Weight sync, trainer -> generators: bucketed snapshots pushed in the background, newest version wins.

- `config`: `run.trainer.weights` (`WeightsSpec`), handed whole to the publisher;
- `buckets`: a state dict cut into ~64 MiB payloads with manifests and CRC-32s, and back without a copy;
- `publisher`: `WeightPublisher`, the trainer's end (snapshot, then one push task per generator);
- `generators`: `GeneratorTargets`, the publisher's targets kept in line with what the generators say;
- `receiver`: `WeightReceiver`, the generator's end (`on_bulk` for TCP, `listen_ucx` for UCX);
- `ucx`: the same frames over ucxx endpoints; `collective`: each bucket broadcast once to every generator of a
  push over a process group (`transport: nccl`: NCCL on GPUs, gloo on CPU); `cuda_ipc`: a GPU buffer opened by
  another process of the host (the primitive of a transport to come); `wire`: the messages and errors.

See docs/weights.md for the wire format and how to choose a transport.
"""
