"""Build a model from a checkpoint folder: config.json plus safetensors (single or sharded), or dummy.

Invariants: the returned model is in eval mode with no grads, its parameters in ``dtype`` on
``device``; every problem with the folder (no config, no weights, a shard named in the index
but absent, missing or misshapen tensors) raises ``CheckpointError`` naming the path or tensor.
Dummy weights depend only on torch's RNG state and each tensor's global name and expert id,
so every EP rank holds its shard of one and the same random model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import zlib
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from epserve.models.config import CheckpointError, ModelConfig
from epserve.models.layers import RMSNorm, StackedExperts
from epserve.models.parallel import ParallelInfo
from epserve.models.registry import get_model_class

LOAD_FORMATS = ("auto", "safetensors", "dummy")
INDEX_FILE = "model.safetensors.index.json"


def load_model(model_path: str | Path, *, dtype: torch.dtype, device: torch.device | str,
               parallel: ParallelInfo = ParallelInfo(), load_format: str = "auto",
               config_overrides: dict[str, Any] | None = None) -> tuple[nn.Module, ModelConfig]:
    """Build the model of ``model_path/config.json`` for this rank and load (or invent) its weights.

    ``config_overrides`` replaces ``ModelConfig`` fields by name after parsing (e.g.
    ``{"num_layers": 2}`` for a dummy benchmark; a hybrid keeps the first ``num_layers`` of its
    ``layer_types`` unless those are overridden too). Returns ``(model, config)``.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not one of {LOAD_FORMATS}")
    path = Path(model_path)
    if not path.is_dir():
        raise CheckpointError(f"model path {path} is not a directory")
    cfg = _apply_overrides(ModelConfig.from_pretrained(path), config_overrides)
    files = [] if load_format == "dummy" else safetensors_files(path)
    device = torch.device(device)
    with device, default_dtype(dtype):
        model = get_model_class(cfg.architecture)(cfg, parallel)
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        model.load_weights(iter_safetensors(files))
    model.eval().requires_grad_(False)
    return model, cfg


def _apply_overrides(cfg: ModelConfig, overrides: dict[str, Any] | None) -> ModelConfig:
    if not overrides:
        return cfg
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"config_overrides: unknown field(s) {unknown}; "
                         f"ModelConfig fields: {sorted(fields)}")
    if "num_layers" in overrides and "layer_types" not in overrides and cfg.layer_types:
        overrides = {**overrides, "layer_types": cfg.layer_types[:overrides["num_layers"]]}
    return dataclasses.replace(cfg, **overrides)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in ``dtype`` (buffers that ask for float32 keep it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# --------------------------------------------------------------------------- safetensors


def safetensors_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint folder: the index's shards, or ``model.safetensors``,
    or every ``*.safetensors``. ``CheckpointError`` when there are none or a shard is absent."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cannot read the shard index {index}: {e!r}") from e
        shards = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(s) for s in shards if not s.is_file()]
        if absent:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(absent)}")
        return shards
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"no safetensors weights in {path} (looked for {INDEX_FILE}, "
                              "model.safetensors, *.safetensors)")
    return found


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream ``(name, tensor)`` pairs, one tensor in memory at a time, on the CPU. A file that
    does not read (cut short, not safetensors) is a ``CheckpointError`` naming it."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise CheckpointError(f"{file}: not a readable safetensors file ({exc})") from None


# --------------------------------------------------------------------------- dummy weights

_DUMMY_STD = 0.02


def _seed_for(base: int, name: str, expert: int = -1) -> int:
    return (base * 1_000_003 + zlib.crc32(f"{name}#{expert}".encode())) % (2**63 - 1)


def init_dummy_weights(model: nn.Module) -> None:
    """Random weights: N(0, 0.02) for matrices, ones for norms; keyed by global tensor name and
    expert id from one draw of torch's current RNG, so a shard matches the unsharded model."""
    base = int(torch.randint(0, 2**31 - 1, (1,)).item())
    done: set[int] = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
                done.add(id(module.weight))
            elif isinstance(module, StackedExperts):
                for pname in ("w13", "w2"):
                    param = getattr(module, pname)
                    done.add(id(param))
                    for j in range(param.shape[0]):
                        _normal(param[j], _seed_for(base, f"{prefix}.{pname}", module.expert_start + j))
        for name, param in model.named_parameters():  # a tied weight appears once
            if id(param) not in done:
                _normal(param, _seed_for(base, name))


def _normal(t: torch.Tensor, seed: int) -> None:
    gen = torch.Generator(device=t.device)
    gen.manual_seed(seed)
    t.normal_(0.0, _DUMMY_STD, generator=gen)
