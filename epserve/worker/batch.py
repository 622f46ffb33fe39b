"""One step's flattened inputs: token ids, positions, KV slots and paged-attention metadata.

Invariants: decode rows come first (one token each, at position ``seq_len``), then prefill
chunks in the caller's order; every new token has a KV slot inside its sequence's block table
(the scheduler reserved it) — a row without one is refused here, before any device work.
Block tables are not rebuilt per step: ``BlockTables`` keeps one row per slot, grown in place.
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import Sequence

import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.traits import SequenceState


@dataclass(frozen=True, slots=True)
class StepRow:
    """One prefill chunk: ``tokens`` fed at positions ``start..``.

    ``sample``: the chunk is the prompt's last, so its last position is sampled.
    ``prompt_targets``: for prompt logprobs, the next-token target of each position (``-1``
    where a position has none); empty when not collecting.
    """

    seq: SequenceState
    tokens: Sequence[int]
    start: int
    sample: bool
    prompt_targets: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class StepInputs:
    """What the forward of one step reads, and the rows it came from.

    ``input_ids``: [T] int64, ``positions``: [T] int64, ``meta``: the paged layout;
    ``sample_index``: [R] int64 flat index of each sampled position: every decode row, then
    each prefill row with ``sample``, in order; ``sampled_prefill``: those prefill rows' indices.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_index: torch.Tensor
    decode_tokens: Sequence[int]
    decode_seqs: Sequence[SequenceState]
    prefill_rows: Sequence[StepRow]
    sampled_prefill: tuple[int, ...]


def _i64(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """[N] int64 from host ints; array.array is ~4x faster than torch.tensor on a list."""
    if not values:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64).to(device)


class BlockTables:
    """Per-slot block tables on the host, one row per sequence slot, grown in place (a step
    gathers its rows instead of rebuilding them)."""

    def __init__(self, max_slots: int, max_blocks_per_seq: int):
        self.table = torch.zeros((max_slots, max_blocks_per_seq), dtype=torch.int32)
        self.max_blocks_per_seq = max_blocks_per_seq

    def set_blocks(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """Write ``blocks`` into row ``slot`` from column ``first`` on."""
        if first + len(blocks) > self.max_blocks_per_seq:
            raise ValueError(f"sequence needs {first + len(blocks)} KV blocks, more than "
                             f"max_model_len allows ({self.max_blocks_per_seq})")
        if blocks:
            self.table[slot, first:first + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)


def _decode_part(seqs: Sequence[SequenceState], bs: int) -> tuple[list[int], list[int]]:
    """Positions and KV slots of the decode rows (one token each, at ``seq_len``); two list
    comprehensions beat ~10 small torch ops on the host for a few hundred rows."""
    pos = [s.seq_len for s in seqs]
    try:
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
    except IndexError:
        bad = next(i for i, s in enumerate(seqs) if s.seq_len >= len(s.block_table) * bs)
        raise ValueError(f"decode row {bad}: no KV block reserved for position "
                         f"{seqs[bad].seq_len}") from None
    return pos, slots


def build_step_inputs(decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      prefill_rows: Sequence[StepRow], tables: BlockTables, block_size: int,
                      device: torch.device) -> StepInputs:
    """Flatten decode rows then prefill chunks into one token batch."""
    nd = len(decode_seqs)
    bs = block_size
    cpu = torch.device("cpu")
    slot_ids = [s.slot_idx for s in decode_seqs] + [row.seq.slot_idx for row in prefill_rows]
    slot_t = _i64(slot_ids, cpu)
    pos, slots = _decode_part(decode_seqs, bs)
    ids = list(decode_tokens)
    seq_lens = [p + 1 for p in pos]
    qsl = list(range(nd + 1))
    sample_index = list(range(nd))
    sampled_prefill = []
    for r, row in enumerate(prefill_rows):
        n, start = len(row.tokens), row.start
        end = start + n
        table = row.seq.block_table
        if n == 0 or end > len(table) * bs:
            raise ValueError(f"prefill row {r}: {n} tokens at {start} need KV blocks through "
                             f"position {end - 1}, the block table covers {len(table) * bs}")
        ids.extend(row.tokens)
        pos.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        qsl.append(qsl[-1] + n)
        seq_lens.append(end)
        if row.sample:
            sample_index.append(qsl[-1] - 1)
            sampled_prefill.append(r)
    width = -(-max(seq_lens) // bs)
    # Two host buffers, one copy each (pinned + non-blocking on CUDA): int64 ids | positions |
    # slots | sample index, and int32 seq_lens | block tables. Every section starts 16-byte
    # aligned: Triton specializes kernels on pointer alignment, so a section whose alignment
    # changed with the row count would compile a new kernel variant in the middle of a run.
    n, ns, nr = len(ids), len(seq_lens), len(sample_index)
    n2, ns4 = n + n % 2, -(-ns // 4) * 4
    pad64 = [0] * (n2 - n)
    pin = device.type == "cuda"
    h64 = torch.frombuffer(array.array("q", ids + pad64 + pos + pad64 + slots + pad64
                                       + sample_index), dtype=torch.int64)
    h32 = torch.empty(ns4 + ns * width, dtype=torch.int32, pin_memory=pin)
    h32[:ns] = torch.frombuffer(array.array("i", seq_lens), dtype=torch.int32)
    torch.index_select(tables.table[:, :width], 0, slot_t, out=h32[ns4:].view(ns, width))
    if pin:
        h64 = h64.pin_memory()
    d64 = h64.to(device, non_blocking=pin)
    d32 = h32.to(device, non_blocking=pin)
    meta = AttentionMetadata(
        slot_mapping=d64[2 * n2:2 * n2 + n],
        query_start_loc=tuple(qsl),
        seq_lens=tuple(seq_lens),
        block_tables=d32[ns4:].view(ns, width),
        block_size=bs,
        seq_lens_t=d32[:ns] if not prefill_rows else None,
    )
    return StepInputs(
        input_ids=d64[:n],
        positions=d64[n2:n2 + n],
        meta=meta,
        sample_index=d64[3 * n2:3 * n2 + nr],
        decode_tokens=decode_tokens, decode_seqs=decode_seqs, prefill_rows=prefill_rows,
        sampled_prefill=tuple(sampled_prefill),
    )
