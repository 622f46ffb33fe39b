"""How one rank's runner is built (``RunnerConfig``) and how ``auto`` device and dtype resolve."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epserve.models.sampling_rules import MAX_LOGPROBS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunnerConfig:
    """How one rank's runner is built. ``num_kv_blocks=None`` sizes the pool: on CPU from
    ``kv_cache_bytes``; on CUDA from what ``gpu_memory_utilization`` of the device leaves
    after the weights (and a reserve for activations). On CUDA with one rank, decode steps
    replay CUDA graphs captured at start (one per ladder rung) unless ``enforce_eager``.
    ``warmup_tokens`` > 0 (CUDA, one rank): an eager forward of that many padded prompt rows
    at start, so the prefill-size Triton kernels compile before the first request, not in it.
    ``decode_lookahead``: queue each pure decode step's likely successor on the device before
    the host reads its tokens (``worker.lookahead``); None: on wherever decode graphs are
    (with recurrent state, for steps of up to 4 rows, whose states it copies aside).
    ``max_logprobs``: the engine's bound on a row's logprobs (-1: the vocabulary size), which
    the rank's validator holds every command to. ``mtp_drafts`` > 0: load the checkpoint's
    MTP head and draft that many tokens per sampled sequence after each step
    (``worker.mtp_drafter``; ``speculative_config`` method ``mtp``). ``speculative_tokens``:
    drafts a verify row may carry (any method): a model with recurrent state then captures
    verify graphs beside the decode graphs (``worker.cuda_graphs``)."""

    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 512 * 2**20
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: int = 2 * 2**30
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    warmup_tokens: int = 0
    decode_lookahead: bool | None = None
    max_logprobs: int = MAX_LOGPROBS
    mtp_drafts: int = 0
    speculative_tokens: int = 0


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA; float32 on CPU (bf16 matmuls are slow there)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return _DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]
