"""Step inputs: every tensor a kernel reads starts 16-byte aligned inside its packed buffer,
whatever the row and sequence counts (Triton compiles one kernel variant per pointer alignment,
so an odd count would otherwise cost a compile in the middle of a run), and holds the values
of the step: decode rows first, then prefill chunks, each token at its block's KV slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from epserve.models.traits import RowSampling
from epserve.worker.batch import BlockTables, RankRows, build_step_inputs
from epserve.worker.step_command import PrefillRow

BS = 4
BLOCKS = {0: [7, 2], 1: [5], 2: [3, 9], 3: [1, 4, 6], 4: [8]}  # slot -> its block table


def _offset_bytes(t) -> int:
    return t.storage_offset() * t.element_size()


def _kv(slot: int, p: int) -> int:
    return BLOCKS[slot][p // BS] * BS + p % BS


@pytest.mark.parametrize("decode", [(), (3,), (3, 4)])
def test_sections_aligned_for_odd_counts(decode):
    tables = BlockTables(8, 4)
    for slot, blocks in BLOCKS.items():
        tables.set_blocks(slot, 0, blocks)
    dpos = {3: 9, 4: 2}  # decode rows: slot -> position
    lens = (5, 3, 7)  # prefill chunks of slots 0, 1, 2: 15 tokens, odd, not a multiple of 4
    prefill = [PrefillRow(0, s, 0, tuple(10 + s + j for j in range(n)), True, 0, -1)
               for s, n in enumerate(lens)]
    nd = len(decode)
    rows = RankRows(np.array(decode, dtype=np.int64),
                    np.array([dpos[s] for s in decode], dtype=np.int64),
                    np.array([40 + s for s in decode], dtype=np.int64), prefill,
                    [RowSampling()] * (nd + 3), [0] * (nd + 3))
    inp = build_step_inputs(rows, tables, BS, torch.device("cpu"))
    meta = inp.meta
    for name, t in (("input_ids", inp.input_ids), ("positions", inp.positions),
                    ("slot_mapping", meta.slot_mapping), ("sample_index", inp.sample_index),
                    ("block_tables", meta.block_tables)):
        assert _offset_bytes(t) % 16 == 0, (name, _offset_bytes(t))
    assert inp.input_ids.tolist() == [40 + s for s in decode] + [
        10 + i + j for i, m in enumerate(lens) for j in range(m)]
    assert inp.positions.tolist() == [dpos[s] for s in decode] + [
        j for m in lens for j in range(m)]
    assert inp.sample_index.tolist() == list(range(nd)) + [nd + 4, nd + 7, nd + 14]
    assert meta.query_start_loc == tuple(range(nd)) + (nd, nd + 5, nd + 8, nd + 15)
    assert meta.seq_lens == tuple(dpos[s] + 1 for s in decode) + lens
    assert meta.block_tables.shape[0] == nd + 3
    for slot, row in zip(list(decode) + [0, 1, 2], meta.block_tables.tolist()):
        n = meta.seq_lens[list(decode + (0, 1, 2)).index(slot)]
        assert row[:-(-n // BS)] == BLOCKS[slot][:-(-n // BS)]
    assert meta.slot_mapping.tolist() == [_kv(s, dpos[s]) for s in decode] + [
        _kv(s, p) for s, m in enumerate(lens) for p in range(m)]
