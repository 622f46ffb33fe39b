"""KvBook: every rank's KV pool and slots in one place, one meaning per lifecycle method, and
an explicit placement policy (no side effects choose a rank; the scheduler reads no rank)."""

from __future__ import annotations

import inspect

import pytest

from epserve.head import scheduler
from epserve.models.traits import SequenceState
from epserve.worker.kv_book import KvBook, Placement

BS = 4


def _book(world: int = 3, blocks: int = 8, slots: int = 4) -> KvBook:
    return KvBook(world, blocks, BS, slots, max_model_len=64)


def _cache_prompt(book: KvBook, rank: int, prompt: list[int]) -> None:
    """Run ``prompt`` on ``rank`` and leave its full blocks in that rank's cache."""
    seq = SequenceState(slot_idx=book.free_slots[rank].pop(), rank=rank)
    assert book.reserve_blocks(seq, len(prompt))
    seq.tokens.extend(prompt)
    seq.seq_len = len(prompt)
    book.cache_sequence(seq)
    book.free_sequence(seq)


def test_placement_prefers_the_cached_prefix_then_free_slots_then_blocks_then_low_rank():
    book = _book()
    assert Placement().choose(book, None) == 0  # all equal: the lowest rank
    prompt = list(range(1, 14))  # 3 full blocks and a bit
    _cache_prompt(book, 2, prompt)
    assert book.alloc_sequence_for(20, prompt).rank == 2  # its prefix is cached there
    # no prompt: rank 2 lost a slot, rank 0 and 1 tie on slots and blocks -> rank 0
    assert book.alloc_sequence().rank == 0
    # then rank 1 has the most free slots
    assert book.alloc_sequence().rank == 1


def test_reserve_only_allocates_and_reclaim_is_explicit():
    book = _book(world=2, blocks=4)
    prompt = list(range(1, 13))  # 3 blocks
    _cache_prompt(book, 0, prompt)
    seq = book.alloc_sequence_for(16, [99, 98])  # no hit anywhere: most free blocks = rank 1
    assert seq.rank == 1
    other = book.alloc_sequence_for(16, [97])
    assert other.rank == 0 and book.num_free_blocks(other) == 1  # 3 cached, 1 free
    assert not book.reserve_blocks(other, 3 * BS)  # never evicts by itself
    assert book.reclaim_prefix_blocks(2, other) == 2
    assert book.reserve_blocks(other, 3 * BS)
    assert book.num_total_blocks(other) == 4 and book.num_total_blocks() == 8
    assert book.shares_kv_pool(other, other) and not book.shares_kv_pool(other, seq)


def test_reclaim_for_a_prompt_frees_blocks_where_that_prompt_goes():
    book = _book(world=2, blocks=4)
    _cache_prompt(book, 1, [1, 2, 3, 4, 5, 6, 7, 8])  # rank 1: 2 cached blocks
    _cache_prompt(book, 0, [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9])  # rank 0: 3 cached blocks
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 50, 51]
    rank = Placement().choose(book, prompt)
    assert rank == 1
    got = book.reclaim_prefix_blocks_for(prompt, -1, 3)
    assert got.free >= 2 and book.pools[0].num_cached_free_blocks() == 3  # rank 0 untouched
    assert book.alloc_sequence_for(16, prompt).rank == rank  # reclaiming kept the choice


def test_the_rank_block_table_gets_every_block_in_order(qwen3_ckpt):
    """Blocks reach the rank only through the step command: after each step the rank's table
    row holds the sequence's blocks, in order, as the book gave them."""
    from epserve import LLM

    model = LLM(model=str(qwen3_ckpt), dtype="float32", block_size=4).model
    seq = model.alloc_sequence()
    prompt = list(range(3, 13))
    for end, reserve in ((5, 5), (10, 11)):
        assert model.reserve_blocks(seq, reserve)
        model.prefill_chunk(prompt, seq, seq.seq_len, end - seq.seq_len, end == len(prompt))
        n = len(seq.block_table)
        assert model.runner.tables.np[seq.slot_idx, :n].tolist() == seq.block_table


def test_the_slot_limit_and_model_len_are_refused_clearly():
    book = _book(world=1, slots=1)
    book.alloc_sequence()
    with pytest.raises(RuntimeError, match="max_num_seqs=1"):
        book.alloc_sequence()
    with pytest.raises(ValueError, match="max_model_len=64"):
        book.alloc_sequence_for(65)


def test_the_scheduler_reads_no_rank():
    code = "\n".join(line.split("#")[0] for line in inspect.getsource(scheduler).splitlines())
    assert ".rank" not in code
