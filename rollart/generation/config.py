"""`run.generator`: which inference engine every generator node runs, on what, and how large its batches are.

Part of the topology (`rollart.topology`), so it imports no torch: the launcher, the CLI and `rollart check` read
it without loading an engine. The generator node builds its engines from it (`rollart.nodes.generator`).
"""

from __future__ import annotations

from typing import Literal

import msgspec

GeneratorDtype = Literal["auto", "float32", "bfloat16", "float16"]


class GeneratorSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """The inference engines every generator node runs."""

    backend: Literal["vllm", "hf", "sim"] = "vllm"
    """vllm: vLLM's async engine (`bin/setup-vllm`; `rollart run` sets it up when missing);
    hf: transformers, for machines without vLLM and for fast tests; sim: simulated (`run.sim`)."""
    max_num_seqs: int = 64
    """Most requests decoded together by one engine (vLLM's `max_num_seqs`)."""
    dtype: GeneratorDtype = "auto"
    """The engines' weights and compute: auto: the checkpoint's own (`torch_dtype` in its config.json; float32
    when it names none), float16 becoming float32 on CPU, where half-precision kernels are missing or slow."""
    device: str = "auto"
    """hf: the device the engine runs on (auto: the node's first visible GPU, else cpu); vllm picks its own."""
    engines: int = 1
    """Engines per generator node, each on `tensor_parallel_size` of the node's GPUs (on CPU: its own share of the
    node's cores); the node sends each new trajectory to the least loaded and keeps a trajectory on its engine."""
    tensor_parallel_size: int = 1
    """GPUs one engine shards its model over (vLLM); a node needs `engines` x this many GPUs."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each GPU an engine may use for weights, activations and KV cache (vLLM, GPU)."""
    kv_cache_gb: float | None = None
    """KV cache per engine in GiB: what vLLM reserves on CPU (None there: 1 GiB); on GPU None lets
    `gpu_memory_utilization` size it, a value fixes it."""
    max_model_len: int | None = None
    """Longest prompt plus completion an engine accepts; None: the model's own (`max_position_embeddings`). Lower it
    for a long-context model whose full length would need more KV cache than the GPU holds."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs / compilation; None: eager on CPU (compiling costs more start-up than it saves
    there), compiled on GPU."""
    kv_store: str | None = None
    """vllm, for `rollout.routing: disaggregated`: a folder every generator reaches (on one machine `/dev/shm/...`,
    across hosts a shared filesystem), through which one engine hands a prefilled prompt's KV cache to the engine
    that decodes it (`rollart.generation.vllm.kv_connector`); a relative path is from the directory the node
    starts in."""

    def validate(self) -> list[tuple[str, str]]:
        """(field, problem) pairs for values that are well-typed but unusable whatever the backend
        (`rollart.generation.registry.check` adds what the backend cannot do)."""
        problems = [
            (key, f"expected an integer >= 1; got {getattr(self, key)}")
            for key in ("max_num_seqs", "engines", "tensor_parallel_size")
            if getattr(self, key) < 1
        ]
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(
                ("gpu_memory_utilization", f"expected a value in (0, 1]; got {self.gpu_memory_utilization}")
            )
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            problems.append(("kv_cache_gb", f"expected a value > 0 or null; got {self.kv_cache_gb}"))
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(("max_model_len", f"expected an integer >= 1 or null; got {self.max_model_len}"))
        if self.kv_store is not None and self.tensor_parallel_size > 1:  # each rank would write the same files
            problems.append(("kv_store", "the KV store holds one rank's KV cache; expected tensor_parallel_size 1"))
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            problems.append(("device", f"expected auto, cpu, cuda or cuda:N; got {self.device!r}"))
        return problems

    def gpus_per_node(self) -> int:
        """GPUs a generator node's engines use together (when it runs on GPUs)."""
        return self.engines * self.tensor_parallel_size
