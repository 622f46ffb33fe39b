"""The start-up prefill warm-up: one eager forward with a full prefill step's shapes, so the
prefill-size Triton kernels compile before the first request instead of inside it (and an
activation shortfall shows at start).

Invariant: every row has KV slot -1, so nothing is written to the cache; attention reads
block 0 (harmless: the result is discarded).
"""

from __future__ import annotations

from typing import Callable

import torch

from epserve.kernels.attention import AttentionMetadata

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
