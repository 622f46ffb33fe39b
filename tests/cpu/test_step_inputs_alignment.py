"""Step inputs: every tensor a kernel reads starts 16-byte aligned inside its packed buffer,
whatever the row and sequence counts (Triton compiles one kernel variant per pointer alignment,
so an odd count would otherwise cost a compile in the middle of a run), and holds the values
of the step."""

from __future__ import annotations

from epserve import LLM
from epserve.models.traits import PrefillSlice


def _offset_bytes(t) -> int:
    return t.storage_offset() * t.element_size()


def test_sections_aligned_for_odd_counts(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_num_batched_tokens=256)
    r = llm.runner
    lens = (5, 3, 7)  # 15 rows, 3 sequences: odd and not a multiple of 4
    slices = []
    for i, n in enumerate(lens):
        seq = r.alloc_sequence()
        assert r.reserve_blocks(seq, n)
        prompt = [10 + i + j for j in range(n)]
        slices.append(PrefillSlice(prompt, seq, 0, n, True))
    inp = r.prepare_step([], [], slices)
    n = sum(lens)
    meta = inp.meta
    for name, t in (("input_ids", inp.input_ids), ("positions", inp.positions),
                    ("slot_mapping", meta.slot_mapping), ("sample_index", inp.sample_index),
                    ("block_tables", meta.block_tables)):
        assert _offset_bytes(t) % 16 == 0, (name, _offset_bytes(t))
    assert inp.input_ids.tolist() == [10 + i + j for i, m in enumerate(lens) for j in range(m)]
    assert inp.positions.tolist() == [j for m in lens for j in range(m)]
    assert inp.sample_index.tolist() == [4, 7, 14]
    assert meta.block_tables.shape[0] == 3
    bs = meta.block_size
    for (sl, m), row in zip(zip(slices, lens), meta.block_tables.tolist()):
        assert row[:-(-m // bs)] == sl.seq.block_table
    slots = meta.slot_mapping.tolist()
    assert len(slots) == n
    assert slots[:5] == [slices[0].seq.block_table[p // bs] * bs + p % bs for p in range(5)]
