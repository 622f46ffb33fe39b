"""One rank's paged-KV block manager: ref counts, the prefix cache and its LRU (plain Python).

Invariants (``check()`` verifies them): every block is in exactly one of three places: the
free list (ref 0, no hash), the LRU of cached free blocks (ref 0, has a hash), or in use
(ref > 0, with or without a hash). A hash names at most one block and a block holds at most
one hash. ``allocate`` takes only from the free list; cached blocks become allocatable only
through ``reclaim_prefix_blocks*`` (the seed's rule: reclaim first, then allocate). Every
public call costs O(blocks it touches), never O(num_blocks), except ``check`` and
``reset_prefix_cache``.

A prefix hash names the content of a full block *and everything before it*: it chains
(parent hash, the block's token ids, adapter id) through blake2b, so two sequences share a
block only if their whole prefixes up to and including that block are equal under the same
adapter. A partial last block is never hashed: its content is still growing.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from typing import Iterable, Sequence

from epserve.models.traits import PrefixReclaim

#: The parent of a sequence's first block.
_ROOT_HASH = b""


class KVPoolExhausted(RuntimeError):
    """``allocate`` asked for more blocks than the free list holds (nothing was allocated)."""


def block_hash(parent: bytes, block_tokens: Sequence[int], adapter_id: int) -> bytes:
    """The chained prefix hash of one full block: 16 bytes of blake2b.

    Little-endian int64s, so the same tokens give the same hash in every process and on every
    rank (the leader and its workers may compare them).
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(struct.pack(f"<q{len(block_tokens)}q", adapter_id, *block_tokens))
    return h.digest()


class KVPool:
    """The paged-KV blocks of one rank: who uses each block, and which cached prefixes they hold.

    ``num_blocks`` blocks of ``block_size`` token slots each. Block ids are ``0..num_blocks-1``.
    With ``enable_prefix_caching=False`` nothing is ever hashed, matched or kept after its last
    reference goes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 0:
            raise ValueError(f"KVPool: num_blocks must be >= 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"KVPool: block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._refs: list[int] = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        # Cached free blocks, least recently freed first: eviction pops from the front.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._in_use = 0

    # ------------------------------------------------------------------ counts

    def num_total_blocks(self) -> int:
        return self._num_blocks

    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out now (cached free blocks not included)."""
        return len(self._free)

    def num_cached_free_blocks(self) -> int:
        """Blocks with ref 0 that still hold a cached prefix (evictable by reclaim)."""
        return len(self._lru)

    def num_used_blocks(self) -> int:
        return self._in_use

    def usage(self) -> float:
        """Fraction of blocks with ref > 0 (0.0 for an empty pool)."""
        return self._in_use / self._num_blocks if self._num_blocks else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    # ------------------------------------------------------------------ allocate / free

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the free list, each with ref 1. Raises ``KVPoolExhausted`` and
        allocates nothing when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"KVPool.allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise KVPoolExhausted(
                f"KV pool exhausted: need {n} blocks, {len(self._free)} free, "
                f"{len(self._lru)} cached-free (reclaim them first), {self._in_use} in use, "
                f"{self._num_blocks} total")
        popleft = self._free.popleft
        ids = [popleft() for _ in range(n)]
        refs = self._refs
        for b in ids:
            refs[b] = 1
        self._in_use += n
        return ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """One more reference to each in-use block (a fork shares its parent's blocks)."""
        ids = list(block_ids)
        refs = self._refs
        for b in ids:
            self._check_id(b)
            if refs[b] <= 0:
                raise ValueError(f"KVPool.incref: block {b} is not in use")
        for b in ids:
            refs[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. A block at ref 0 goes to the LRU's newest end if it
        holds a prefix hash, else back to the free list.

        Blocks are released last to first: a sequence's tail then sits older in the LRU than
        its head and is evicted first, which is right because evicting a head block makes
        every block after it unreachable by ``match_prefix``.
        """
        refs = self._refs
        for b in block_ids:
            self._check_id(b)
            if refs[b] <= 0:
                raise ValueError(f"KVPool.free: block {b} is not in use (double free?)")
        hash_of, lru, free = self._hash_of, self._lru, self._free
        for b in reversed(block_ids):
            r = refs[b] - 1
            if r < 0:  # only reachable when one call names a block more often than its refs
                raise ValueError(f"KVPool.free: block {b} freed more often than referenced")
            refs[b] = r
            if r == 0:
                self._in_use -= 1
                if hash_of[b] is not None:
                    lru[b] = None
                else:
                    free.append(b)

    def _check_id(self, b: int) -> None:
        if not 0 <= b < self._num_blocks:
            raise ValueError(f"KVPool: block id {b} out of range [0, {self._num_blocks})")

    # ------------------------------------------------------------------ prefix cache

    def _walk_prefix(self, tokens: Sequence[int], adapter_id: int,
                     max_tokens: int | None) -> list[int]:
        """Block ids of the longest chain of cached full blocks matching ``tokens[:max_tokens]``."""
        if not self.enable_prefix_caching:
            return []
        n = len(tokens) if max_tokens is None else max(0, min(max_tokens, len(tokens)))
        bs, block_of = self.block_size, self._block_of
        parent = _ROOT_HASH
        found: list[int] = []
        for start in range(0, n - n % bs, bs):
            parent = block_hash(parent, tokens[start:start + bs], adapter_id)
            b = block_of.get(parent)
            if b is None:
                break
            found.append(b)
        return found

    def peek_prefix(self, tokens: Sequence[int], adapter_id: int = 0,
                    max_tokens: int | None = None) -> int:
        """How many leading full blocks of ``tokens[:max_tokens]`` are cached (takes no refs)."""
        return len(self._walk_prefix(tokens, adapter_id, max_tokens))

    def match_prefix(self, tokens: Sequence[int], adapter_id: int = 0,
                     max_tokens: int | None = None) -> list[int]:
        """Take a reference to each block of the longest cached prefix of ``tokens[:max_tokens]``
        and return their ids in order. Blocks at ref 0 are revived out of the LRU.

        A caller that must compute at least one prompt token passes ``len(prompt) - 1``.
        """
        found = self._walk_prefix(tokens, adapter_id, max_tokens)
        refs, lru = self._refs, self._lru
        for b in found:
            if refs[b] == 0:
                del lru[b]
                self._in_use += 1
            refs[b] += 1
        return found

    def cache_blocks(self, tokens: Sequence[int], block_table: Sequence[int], num_tokens: int,
                     adapter_id: int = 0) -> None:
        """Register prefix hashes for the full blocks of ``block_table`` covering
        ``tokens[:num_tokens]`` (whose KV must be written). Blocks already registered are
        skipped; when another block already owns a hash, the first owner keeps it and this block
        stays unhashed (it is freed normally, not cached)."""
        if not self.enable_prefix_caching:
            return
        n = max(0, min(num_tokens, len(tokens)))
        bs, refs, hash_of, block_of = self.block_size, self._refs, self._hash_of, self._block_of
        num_full = min(n // bs, len(block_table))
        parent = _ROOT_HASH
        for i in range(num_full):
            b = block_table[i]
            self._check_id(b)
            if refs[b] <= 0:
                raise ValueError(f"KVPool.cache_blocks: block {b} is not in use")
            h = block_hash(parent, tokens[i * bs:(i + 1) * bs], adapter_id)
            parent = h
            have = hash_of[b]
            if have == h:
                continue
            if have is not None:
                # A hashed block's content never changes, so this means the caller's tokens do
                # not match what the block holds: caching it would serve wrong KV later.
                raise ValueError(f"KVPool.cache_blocks: block {b} already caches a different "
                                 f"prefix than tokens[{i * bs}:{(i + 1) * bs}]")
            if h in block_of:
                continue
            hash_of[b] = h
            block_of[h] = b

    def _evict(self, b: int) -> None:
        """Move one cached free block out of the LRU to the free list, dropping its hash."""
        del self._lru[b]
        h = self._hash_of[b]
        self._hash_of[b] = None
        del self._block_of[h]
        self._free.append(b)

    def reclaim_prefix_blocks(self, n: int) -> int:
        """Evict up to ``n`` cached free blocks, least recently freed first; return how many."""
        lru = self._lru
        count = 0
        while count < n and lru:
            b = next(iter(lru))
            self._evict(b)
            count += 1
        return count

    def reclaim_prefix_blocks_for(self, prompt: Sequence[int], adapter_id: int,
                                  blocks_needed: int,
                                  max_tokens: int | None = None) -> PrefixReclaim:
        """Free enough blocks for a prefill of ``prompt`` that needs ``blocks_needed`` in all.

        The prompt's own cached prefix (``peek_prefix`` with the same ``max_tokens`` the
        caller will pass to ``match_prefix``) is reused, not allocated: it lowers the target and
        is never evicted here. Evicts other cached blocks, LRU first, until
        ``num_free_blocks() >= target`` or none is left.
        """
        reuse = self._walk_prefix(prompt, adapter_id, max_tokens)
        target = max(0, blocks_needed - len(reuse))
        need = target - len(self._free)
        if need > 0 and self._lru:
            protected = set(reuse)
            victims: list[int] = []
            for b in self._lru:  # oldest first; stops as soon as enough are found
                if len(victims) >= need:
                    break
                if b not in protected:
                    victims.append(b)
            for b in victims:
                self._evict(b)
        return PrefixReclaim(target=target, free=len(self._free))

    def reset_prefix_cache(self) -> int:
        """Forget every prefix hash: cached free blocks go to the free list and in-use blocks
        will be freed uncached. Returns how many blocks moved to the free list. O(num_blocks)."""
        moved = len(self._lru)
        self._free.extend(self._lru)
        self._lru.clear()
        self._block_of.clear()
        self._hash_of = [None] * self._num_blocks
        return moved

    # ------------------------------------------------------------------ invariants

    def check(self) -> bool:
        """Verify every invariant in O(num_blocks); raise ``AssertionError`` naming the first
        broken one, else return True. For tests and debugging, not for the hot path."""
        def fail(msg: str) -> None:
            raise AssertionError(f"KVPool invariant: {msg}")

        free_set = set(self._free)
        if len(free_set) != len(self._free):
            fail("a block is on the free list twice")
        in_use = 0
        for b in range(self._num_blocks):
            r, h = self._refs[b], self._hash_of[b]
            places = (b in free_set) + (b in self._lru) + (r > 0)
            if places != 1:
                fail(f"block {b} is in {places} places (ref {r})")
            if r < 0:
                fail(f"block {b} has ref {r}")
            if b in free_set and h is not None:
                fail(f"free block {b} holds a hash")
            if b in self._lru and h is None:
                fail(f"LRU block {b} holds no hash")
            if h is not None and self._block_of.get(h) != b:
                fail(f"block {b}'s hash is not mapped back to it")
            in_use += r > 0
        if len(self._block_of) != sum(h is not None for h in self._hash_of):
            fail("hash map and per-block hashes disagree in size")
        if in_use != self._in_use:
            fail(f"in-use counter {self._in_use} != {in_use}")
        if not self.enable_prefix_caching and (self._block_of or self._lru):
            fail("prefix caching is off but blocks hold hashes")
        return True
