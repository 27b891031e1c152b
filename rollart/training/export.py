"""A training checkpoint as a Hugging Face model folder (`rollart export`): config, safetensors, tokenizer.

Two kinds of checkpoint, told apart by what is in the folder:

- torch (`rollart.training.torch.engine`): already a Hugging Face folder beside `optimizer.pt`. Its
  files are copied as they are (`dtype: auto`), or the model is loaded and saved again in the
  dtype asked for.
- fsdp2 (`rollart.training.fsdp.rank`): the model's `config.json` and tokenizer beside `dcp/`, the
  `torch.distributed.checkpoint` shards of `{"model": <PolicyLogprobs state dict>, "optim": ...}`.
  The model is built from its config on the meta device (no memory, no random init); only the
  `model.lm.` entries are read from the shards, in one process without a process group, into
  tensors of the shape and dtype the checkpoint's metadata records, a few at a time so progress
  can be shown; the optimizer state is never read. Peak memory: one copy of the weights.

A LoRA run's checkpoint (either kind; `engine.json` holds the LoRA settings and the base model's path)
holds the adapters, not the base: by default the export is the base with the adapters merged into
its weights (`rollart.lora.adapters.merge_adapters`), a plain Hugging Face folder; with `adapters` it
is the adapter folder alone, in PEFT's format (`peft.PeftModel.from_pretrained(base, out)`, vLLM's
`LoRARequest`). Both read the base from where the run trained it.

Everything else a Hugging Face folder carries (tokenizer files, chat template, generation config)
is copied; the training state (`*.pt`, `engine.json`, `dcp/`) is not. The folder is written
under a staging name beside `out` and renamed into place, so a failed export leaves no half of one.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rollart.errors import RollartError
from rollart.training.layout import DCP_FOLDER, DCP_METADATA, ENGINE_FILE, MODEL_PREFIX

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from transformers import PreTrainedModel

ExportDtype = Literal["auto", "bf16", "fp32"]
Progress = Callable[[str], None]

WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model*.bin.index.json")
READ_BYTES = 1 << 30
"""Read the shards about this many bytes at a time (one progress line each)."""


class ExportError(RollartError):
    """The checkpoint cannot be exported (missing, half-written, unknown) or `out` is in the way."""


def checkpoint_kind(path: Path) -> Literal["torch", "fsdp2"]:
    """Which backend wrote the checkpoint folder `path`; raises ExportError when it is missing,
    half-written, or not a checkpoint at all."""
    if not path.is_dir():
        raise ExportError(f"{path}: no such checkpoint folder")
    if (path / DCP_FOLDER).is_dir():
        missing = [p for p in (DCP_FOLDER + "/" + DCP_METADATA, ENGINE_FILE, "config.json") if not (path / p).exists()]
        if missing:
            raise ExportError(f"{path}: a half-written fsdp2 checkpoint ({', '.join(missing)} missing)")
        return "fsdp2"
    if not (path / "config.json").exists() or not _weight_files(path):
        raise ExportError(f"{path}: not a checkpoint (neither {DCP_FOLDER}/ shards nor config.json with weights)")
    for index in path.glob("*.index.json"):
        shards = set(json.loads(index.read_text())["weight_map"].values())
        if missing := sorted(s for s in shards if not (path / s).exists()):
            raise ExportError(f"{path}: a half-written checkpoint ({', '.join(missing)} missing)")
    return "torch"


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    *,
    dtype: ExportDtype = "auto",
    force: bool = False,
    adapters: bool = False,
    progress: Progress = lambda line: None,
) -> Path:
    """Write the policy of `checkpoint` (a folder `TrainingEngine.save` wrote) to `out` as a Hugging
    Face model folder, or with `adapters` a LoRA checkpoint's adapter folder (module docstring);
    returns `out`. `out` must not exist or be empty, unless `force` (then it is replaced once the
    new folder is whole)."""
    checkpoint, out = checkpoint.resolve(), out.resolve()
    kind = checkpoint_kind(checkpoint)
    lora = lora_settings(checkpoint)
    if adapters and lora is None:
        raise ExportError(f"{checkpoint}: --adapters exports LoRA adapters, and this run trained every weight")
    if out == checkpoint or out in checkpoint.parents or checkpoint in out.parents:
        raise ExportError(f"{out}: the export and the checkpoint {checkpoint} must not contain each other")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty (--force replaces it)")
    staging = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        progress(f"exporting the {kind} checkpoint {checkpoint} to {out} (dtype {dtype})")
        if lora is not None:
            _export_lora(checkpoint, kind, lora, staging, dtype=dtype, adapters=adapters, progress=progress)
        elif kind == "torch" and dtype == "auto":
            for weights in _weight_files(checkpoint):
                progress(f"copying {weights.name} ({weights.stat().st_size / 2**20:.1f} MiB)")
                shutil.copy2(weights, staging / weights.name)
            shutil.copy2(checkpoint / "config.json", staging / "config.json")
        else:
            model = _load_hf(checkpoint, dtype) if kind == "torch" else _load_dcp(checkpoint, dtype, progress)
            progress(f"writing safetensors ({_bytes(model.parameters()) / 2**20:.1f} MiB, {model.dtype})")
            model.save_pretrained(staging)
            del model
        for item in [] if adapters else _other_files(checkpoint):
            shutil.copy2(item, staging / item.name)  # the checkpoint's generation config over the rebuilt one's
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(f"wrote {out}")
    return out


# -- the two kinds ------------------------------------------------------------------------------


def lora_settings(checkpoint: Path) -> dict[str, Any] | None:
    """A LoRA checkpoint's `engine.json` (`lora`: the settings, `base_model`: the base's path); None
    for a checkpoint of every weight."""
    engine = checkpoint / ENGINE_FILE
    if not engine.is_file():
        return None
    settings: dict[str, Any] = json.loads(engine.read_text())
    return settings if "lora" in settings else None


def _export_lora(
    checkpoint: Path,
    kind: str,
    settings: dict[str, Any],
    staging: Path,
    *,
    dtype: ExportDtype,
    adapters: bool,
    progress: Progress,
) -> None:
    """The adapter folder, or the base with the adapters merged, into `staging`."""
    import msgspec

    from rollart.lora.adapters import merge_adapters, read_peft_adapter, write_peft_adapter
    from rollart.lora.spec import LoraSpec

    spec = msgspec.convert(settings["lora"], LoraSpec)
    base = Path(settings["base_model"])
    tensors = read_peft_adapter(checkpoint) if kind == "torch" else _read_dcp_adapters(checkpoint)
    if adapters:
        cast = _torch_dtype(dtype)
        progress(f"writing {len(tensors)} adapter tensors (rank {spec.rank}, base {base})")
        write_peft_adapter(staging, {n: t if cast is None else t.to(cast) for n, t in tensors.items()}, spec, base)
        return
    if not (base / "config.json").is_file():
        raise ExportError(
            f"{checkpoint}: LoRA adapters on the base model {base}, which is not there (--adapters exports them alone)"
        )
    progress(f"merging {len(tensors)} adapter tensors (rank {spec.rank}) into the base model {base}")
    model = _load_hf(base, dtype)
    model.load_state_dict(merge_adapters(model.state_dict(), tensors, spec), strict=False)
    model.save_pretrained(staging)


def _read_dcp_adapters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The adapters of an fsdp2 LoRA checkpoint's shards, by PEFT's names (they are small: read at once)."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as Entry
    from torch.distributed.checkpoint.state_dict_loader import load

    from rollart.lora.adapters import is_adapter, peft_name

    shards = str(checkpoint / DCP_FOLDER)
    entries = FileSystemReader(shards).read_metadata().state_dict_metadata
    part = {
        key.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in entries.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, Entry) and is_adapter(key)
    }
    if not part:
        raise ExportError(f"{shards}: no adapter entries, though engine.json says LoRA")
    with warnings.catch_warnings():  # a single process without a process group is what we mean
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load({"model": part}, checkpoint_id=shards, no_dist=True)
    return {peft_name(name.removeprefix("lm.")): tensor for name, tensor in part.items()}


def _torch_dtype(dtype: ExportDtype) -> torch.dtype | None:
    import torch

    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype)


def _load_hf(checkpoint: Path, dtype: ExportDtype) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=_torch_dtype(dtype) or "auto", local_files_only=True
    )
    return model


def _load_dcp(checkpoint: Path, dtype: ExportDtype, progress: Progress) -> PreTrainedModel:
    """The model of an fsdp2 checkpoint, on CPU, reading only its weights from the shards."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata as Entry
    from torch.distributed.checkpoint.state_dict_loader import load
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint), local_files_only=True)
    with torch.device("meta"):  # no memory and no random init: the weights are assigned below
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    shards = str(checkpoint / DCP_FOLDER)
    entries = FileSystemReader(shards).read_metadata().state_dict_metadata
    tied = _tied_names(model)  # a tied output head is the embedding: read it once
    wanted = {
        key.removeprefix("model."): meta
        for key, meta in entries.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, Entry) and key.removeprefix(MODEL_PREFIX) not in tied
    }
    if not wanted:
        raise ExportError(f"{shards}: no {MODEL_PREFIX}* entries: not a policy checkpoint of the fsdp2 backend")
    total = sum(_size(meta) for meta in wanted.values())
    progress(f"reading {len(wanted)} tensors ({total / 2**20:.1f} MiB) from {shards}, without the optimizer state")
    cast = _torch_dtype(dtype)
    weights: dict[str, torch.Tensor] = {}
    done = 0
    for names in _batches(wanted, READ_BYTES):
        part = {name: torch.empty(wanted[name].size, dtype=wanted[name].properties.dtype) for name in names}
        with warnings.catch_warnings():  # a single process without a process group is what we mean
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            load({"model": part}, checkpoint_id=shards, no_dist=True)
        weights |= {name.removeprefix("lm."): t if cast is None else t.to(cast) for name, t in part.items()}
        done += sum(_size(wanted[name]) for name in names)
        progress(f"read {done / 2**20:.1f} / {total / 2**20:.1f} MiB")
    result = model.load_state_dict(weights, strict=False, assign=True)
    if result.unexpected_keys:
        raise ExportError(f"{shards}: weights the model of config.json has no place for: {result.unexpected_keys}")
    model.tie_weights()
    if missing := [name for name, p in model.named_parameters() if p.is_meta]:
        raise ExportError(f"{shards}: weights missing from the shards: {missing}")
    return model


def _tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names that are another, earlier name's parameter (a tied output head)."""
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied.add(name)
        else:
            first[id(param)] = name
    return tied


def _size(meta: TensorStorageMetadata) -> int:
    return meta.size.numel() * meta.properties.dtype.itemsize


def _batches(wanted: dict[str, TensorStorageMetadata], limit: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for name, meta in wanted.items():
        batch.append(name)
        size += _size(meta)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


# -- files --------------------------------------------------------------------------------------


def _weight_files(path: Path) -> list[Path]:
    return sorted({f for pattern in WEIGHTS for f in path.glob(pattern) if f.is_file()})


def _other_files(checkpoint: Path) -> list[Path]:
    """What a Hugging Face folder carries beside config and weights (tokenizer, chat template,
    generation config); not the training state (`*.pt`, `engine.json`) nor any folder (`dcp/`)."""
    skip = {"config.json", ENGINE_FILE, "adapter_config.json", *(f.name for f in _weight_files(checkpoint))}
    return sorted(
        f for f in checkpoint.iterdir() if f.is_file() and f.name not in skip and f.suffix != ".pt" and f.name[0] != "."
    )


def _bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
