"""KvBook: every rank's KV pool and sequence slots, kept in one place on rank 0.

Owns the KV lifecycle of the ``Model`` traits (allocate a sequence, match its cached prefix,
reserve blocks, cache, free, the pool counts and prefix reclaim) for any number of ranks, with
one meaning for each method; the step's ranks learn block ids from the step command. Where a
new sequence goes is ``Placement``, an explicit policy, and a sequence's rank is read only here
and by the step that routes its rows: the scheduler asks ``shares_kv_pool`` and passes the
sequence to the counts, never a rank.

Invariants: a sequence's blocks all come from its own rank's pool; ``reserve_blocks`` only
allocates (reclaiming cached blocks is the caller's ``reclaim_prefix_blocks``); the placement
of a prompt is a pure function of the pools and slots, and reclaiming for that prompt
(``reclaim_prefix_blocks_for``, which keeps the prompt's own prefix) only adds free blocks to
the rank it picked, so ``alloc_sequence_for`` after it picks the same rank. The ranks' block tables
learn a sequence's blocks from the step command only (``worker.step_model``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from epserve.models.sampling_rules import penalized
from epserve.models.traits import PrefixReclaim, SequenceState
from epserve.worker.kv_pool import KVPool

@dataclass(frozen=True)
class Placement:
    """Where a new sequence goes: the rank whose cache holds the longest prefix of its prompt,
    then the one with the most free sequence slots, then the most free KV blocks, then the
    lowest rank."""

    def choose(self, book: "KvBook", prompt: Sequence[int] | None) -> int:
        def score(r: int) -> tuple[int, int, int, int]:
            pool = book.pools[r]
            hit = pool.peek_prefix(prompt, 0, max_tokens=len(prompt) - 1) if prompt else 0
            return hit, len(book.free_slots[r]), pool.num_free_blocks(), -r

        return max(range(book.world_size), key=score)


class KvBook:
    """KV pools and slots of ``world_size`` ranks (``num_blocks`` blocks and ``max_num_seqs``
    slots each)."""

    def __init__(self, world_size: int, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, enable_prefix_caching: bool = True,
                 placement: Placement = Placement()):
        self.world_size = world_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.placement = placement
        self.pools = [KVPool(num_blocks, block_size, enable_prefix_caching)
                      for _ in range(world_size)]
        self.free_slots = [list(range(max_num_seqs - 1, -1, -1)) for _ in range(world_size)]
        # sequences whose tables ``reserve_blocks`` grew since the last command every rank
        # ran (the step model clears it): where a repeated decode row's new blocks are found
        self.grown: list[SequenceState] = []

    # ------------------------------------------------------------------ sequences

    def alloc_sequence(self, prompt: Sequence[int] | None = None) -> SequenceState:
        """A sequence on the rank ``placement`` picks for ``prompt``."""
        rank = self.placement.choose(self, prompt)
        if not self.free_slots[rank]:
            where = f" on rank {rank}" if self.world_size > 1 else ""
            raise RuntimeError(f"no free sequence slot{where} (max_num_seqs="
                               f"{self.max_num_seqs})")
        return SequenceState(slot_idx=self.free_slots[rank].pop(), rank=rank)

    def alloc_sequence_for(self, budget_tokens: int,
                           prompt: Sequence[int] | None = None) -> SequenceState:
        if budget_tokens > self.max_model_len:
            raise ValueError(f"{budget_tokens} tokens exceed max_model_len={self.max_model_len}")
        return self.alloc_sequence(prompt)

    def match_prefix(self, seq: SequenceState, prompt: Sequence[int]) -> int:
        """Take the cached full blocks of ``prompt``'s prefix from ``seq``'s pool; the last
        prompt token is always recomputed (its logits are needed). The tokens reused."""
        if seq.prefix_lookup_applied:
            return seq.cached_prefix_tokens
        seq.prefix_lookup_applied = True
        # a scored prompt, or a penalized row (its rank needs every prompt token): no reuse
        if seq.collect_prompt_logprobs is not None or len(prompt) < 2 or penalized(seq.sampling):
            return 0
        blocks = self.pools[seq.rank].match_prefix(prompt, seq.adapter_id,
                                                   max_tokens=len(prompt) - 1)
        n = len(blocks) * self.block_size
        seq.block_table.extend(blocks)
        seq.tokens.extend(prompt[:n])
        seq.seq_len = seq.kv_valid_tokens = n
        seq.cached_prefix_tokens = seq.reused_prefix_tokens = n
        seq.cached_prefix_blocks = len(blocks)
        return n

    def reserve_blocks(self, seq: SequenceState, num_tokens: int) -> bool:
        """Grow ``seq``'s table to cover ``num_tokens`` positions from its own pool; False
        (nothing taken) when that pool's free blocks are short."""
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        pool = self.pools[seq.rank]
        if need > pool.num_free_blocks():
            return False
        seq.block_table.extend(pool.allocate(need))
        self.grown.append(seq)
        return True

    def reserve_ahead(self, seq: SequenceState, num_tokens: int) -> bool:
        """``reserve_blocks`` for blocks a step takes before the scheduler would (the decode
        lookahead's next position, the MTP drafts'): when the free blocks are short it evicts
        cached prefix blocks of ``seq``'s pool first, as the scheduler does before the next
        step, and never preempts. A pool that has served for a while holds every free block
        as a cached prefix: without the eviction the lookahead stopped at each block boundary
        (bench/RESULTS.md, session 25)."""
        if self.reserve_blocks(seq, num_tokens):
            return True
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        return self.reclaim_prefix_blocks(need, seq) > 0 and self.reserve_blocks(seq, num_tokens)

    def trim(self, seq: SequenceState, num_tokens: int) -> int:
        """Give back ``seq``'s blocks past those covering ``num_tokens`` positions (a verify's
        rejected tail); the blocks kept."""
        keep = -(-num_tokens // self.block_size)
        if keep < len(seq.block_table):
            self.pools[seq.rank].free(seq.block_table[keep:])
            del seq.block_table[keep:]
        return len(seq.block_table)

    def cache_sequence(self, seq: SequenceState) -> None:
        self.pools[seq.rank].cache_blocks(seq.tokens, seq.block_table, seq.seq_len,
                                          seq.adapter_id)

    def free_sequence(self, seq: SequenceState) -> bool:
        """Return ``seq``'s blocks and slot; True when it held a slot (now released)."""
        self.pools[seq.rank].free(seq.block_table)
        seq.block_table.clear()
        seq.seq_len = 0
        if seq.slot_idx < 0:
            return False
        self.free_slots[seq.rank].append(seq.slot_idx)
        seq.slot_idx = -1
        return True

    def shares_kv_pool(self, a: SequenceState, b: SequenceState) -> bool:
        """Whether freeing ``b``'s blocks can make room for ``a``."""
        return a.rank == b.rank

    # ------------------------------------------------------------------ counts and reclaim

    def _pools_of(self, seq: SequenceState | None) -> list[KVPool]:
        return self.pools if seq is None else [self.pools[seq.rank]]

    def num_free_blocks(self, seq: SequenceState | None = None) -> int:
        """Free blocks of the pool ``seq`` draws from (None: of every pool)."""
        return sum(p.num_free_blocks() for p in self._pools_of(seq))

    def num_total_blocks(self, seq: SequenceState | None = None) -> int:
        """Blocks of the pool ``seq`` draws from (None: of every pool)."""
        return sum(p.num_total_blocks() for p in self._pools_of(seq))

    def kv_cache_usage(self) -> float:
        """Blocks held by sequences / all blocks (cached free blocks count as free)."""
        return sum(p.usage() for p in self.pools) / len(self.pools)

    def reclaim_prefix_blocks(self, num_blocks: int, seq: SequenceState | None = None) -> int:
        """Evict up to ``num_blocks`` cached free blocks from ``seq``'s pool (None: from each
        pool in turn); the number evicted."""
        got = 0
        for pool in self._pools_of(seq):
            if got >= num_blocks:
                break
            got += pool.reclaim_prefix_blocks(num_blocks - got)
        return got

    def reclaim_prefix_blocks_for(self, prompt: Sequence[int], adapter_slot: int,
                                  blocks_needed: int) -> PrefixReclaim:
        """Make ``blocks_needed`` free blocks on the rank ``prompt`` will be placed on,
        keeping its own cached prefix (the last prompt token is always recomputed)."""
        rank = self.placement.choose(self, prompt)
        return self.pools[rank].reclaim_prefix_blocks_for(prompt, 0, blocks_needed,
                                                          max_tokens=max(len(prompt) - 1, 0))


class KvLifecycle:
    """The ``Model`` lifecycle methods over ``self.book`` (one implementation for every
    ``ep_size``; a class that mixes this in sets ``book``)."""

    book: KvBook

    def alloc_sequence(self) -> SequenceState:
        return self.book.alloc_sequence()

    def alloc_sequence_for(self, budget_tokens: int,
                           prompt: Sequence[int] | None = None) -> SequenceState:
        return self.book.alloc_sequence_for(budget_tokens, prompt)

    def match_prefix(self, seq: SequenceState, prompt: Sequence[int]) -> int:
        return self.book.match_prefix(seq, prompt)

    def reserve_blocks(self, seq: SequenceState, num_tokens: int) -> bool:
        return self.book.reserve_blocks(seq, num_tokens)

    def cache_sequence(self, seq: SequenceState) -> None:
        self.book.cache_sequence(seq)

    def free_sequence(self, seq: SequenceState) -> None:
        self.book.free_sequence(seq)

    def shares_kv_pool(self, a: SequenceState, b: SequenceState) -> bool:
        return self.book.shares_kv_pool(a, b)

    def num_free_blocks(self, seq: SequenceState | None = None) -> int:
        return self.book.num_free_blocks(seq)

    def num_total_blocks(self, seq: SequenceState | None = None) -> int:
        return self.book.num_total_blocks(seq)

    def kv_cache_usage(self) -> float:
        return self.book.kv_cache_usage()

    def reclaim_prefix_blocks(self, num_blocks: int, seq: SequenceState | None = None) -> int:
        return self.book.reclaim_prefix_blocks(num_blocks, seq)

    def reclaim_prefix_blocks_for(self, prompt: Sequence[int], adapter_slot: int,
                                  blocks_needed: int) -> PrefixReclaim:
        return self.book.reclaim_prefix_blocks_for(prompt, adapter_slot, blocks_needed)
