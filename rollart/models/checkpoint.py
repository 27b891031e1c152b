"""What a Hugging Face model folder says about itself, read without loading it: its dtype and its stop tokens.

`config.json` names the dtype the weights were saved in (`torch_dtype`, or `dtype` as transformers 5 writes
it); `generation_config.json` names the ids that end a generation (`eos_token_id`, one or a list: Qwen3's
chat models list both `<|im_end|>` and `<|endoftext|>`). Plain JSON, no torch: the env-host, the topology
checks and the generator read them before any model is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollart.errors import ConfigError

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a model folder's file; ConfigError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object; got {type(data).__name__}")
    return data


def saved_dtype(model_dir: str | Path) -> str | None:
    """The dtype the folder's weights were saved in (`float32`, `bfloat16`, `float16`); None when its
    config.json names none (or names one this project does not run)."""
    config = Path(model_dir) / "config.json"
    if not config.exists():
        return None
    name = config_dtype(read_json(config))
    return name if name in FLOAT_DTYPES else None


def config_dtype(config: dict[str, Any]) -> str | None:
    """The dtype a config.json's contents name (`torch_dtype`, or `dtype` as transformers 5 writes it), without
    torch's `torch.` prefix; None when it names none."""
    name = config.get("torch_dtype") or config.get("dtype")
    return str(name).removeprefix("torch.") if name is not None else None


def engine_dtype(wanted: str, model_dir: str | Path, *, on_gpu: bool) -> str:
    """The dtype an inference engine runs: `wanted` unless it is `auto`, which means the checkpoint's own
    (float32 when it names none), float16 becoming float32 off the GPU (CPU kernels for it are missing or
    slow)."""
    if wanted != "auto":
        return wanted
    dtype = saved_dtype(model_dir) or "float32"
    return "float32" if dtype == "float16" and not on_gpu else dtype


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """The ids `generation_config.json` says end a generation; [] when the folder has none."""
    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return []
    ids = read_json(path).get("eos_token_id")
    if ids is None:
        return []
    values = ids if isinstance(ids, list) else [ids]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in values):
        raise ConfigError(f"{path}: eos_token_id: expected an integer or a list of integers; got {ids!r}")
    return sorted(set(values))


def checkpoint_shapes(model_path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model folder's safetensors files (headers only); empty if there are none."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                shapes[name] = tuple(checkpoint.get_slice(name).get_shape())
    return shapes
