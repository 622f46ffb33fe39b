"""The start-up warm-up: eager prefill forwards of every step size class, then a sampling of
each kind, so the Triton kernels a step can launch compile before the first request instead of
inside it (and an activation shortfall shows at start).

Triton compiles a kernel once per variant (its constexprs: tile sizes, which layout), and some
ops pick their variant by the step's size: the routed experts' tiles and layout change with the
pairs per expert (``kernels.moe.token_classes``). A module with such a choice says at which step
sizes it changes (``warmup_token_counts(max_tokens)``); the warm-up runs a forward at each, and
at the full step. (``bench/jit_variants.py`` counts what a workload still compiles after it.)

Invariant: every row has KV slot -1, so nothing is written to the cache; attention reads
block 0 (harmless: the result is discarded).
"""

from __future__ import annotations

from typing import Callable

import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.traits import RowSampling
from epserve.worker.sampler import sample_rows

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


@torch.inference_mode()
def warm_up_prefill(forward: Forward, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    num_tokens: int, max_model_len: int, block_size: int,
                    device: torch.device, spare_state_slot: int | None = None) -> torch.Tensor:
    """Run ``forward`` on ``num_tokens`` padded prompt rows (prompts of at most
    ``max_model_len - 1`` tokens) and ``compute_logits`` on each prompt's last row.
    ``spare_state_slot``: the recurrent-state slot every row uses (a model with such state;
    what it holds is never read). Returns the hidden states [T, H]."""
    if num_tokens <= 0:
        raise ValueError(f"warm_up_prefill: num_tokens must be > 0, got {num_tokens}")
    per = max(1, min(num_tokens, max_model_len - 1))
    lens = [per] * (num_tokens // per) + ([num_tokens % per] if num_tokens % per else [])
    positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens]).to(device)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=tuple(qsl), seq_lens=tuple(lens),
        block_tables=torch.zeros((len(lens), -(-per // block_size)), dtype=torch.int32,
                                 device=device),
        block_size=block_size,
        state_slots=None if spare_state_slot is None else torch.full(
            (len(lens),), spare_state_slot, dtype=torch.int64, device=device))
    hidden = forward(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, meta)
    compute_logits(hidden[torch.tensor(qsl[1:], device=device) - 1])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return hidden


def warmup_token_counts(model: torch.nn.Module, num_tokens: int) -> list[int]:
    """The step sizes to warm up: ``num_tokens`` first (the largest: an activation shortfall
    shows at once), then every smaller size at which one of ``model``'s modules changes a
    kernel variant (its ``warmup_token_counts(num_tokens)``), descending."""
    sizes = {n for m in model.modules() if hasattr(m, "warmup_token_counts")
             for n in m.warmup_token_counts(num_tokens) if 0 < n < num_tokens}
    return [num_tokens, *sorted(sizes, reverse=True)]


@torch.inference_mode()
def warm_up_sampling(logits: torch.Tensor) -> None:
    """Sample ``logits`` ([R >= 1, V] float32) once per kind of row: greedy, and random with
    top-k, top-p, min-p, a banned id and logprobs (the kernels a first request would compile).
    """
    kinds = [RowSampling(temperature=0.0),
             RowSampling(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=1,
                         banned_token_ids=(0,), logprobs=2)]
    rows = [kinds[i % len(kinds)] for i in range(logits.shape[0])]
    sample_rows(logits, rows, [0] * len(rows))
