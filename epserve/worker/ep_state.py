"""EpMirror: the state every rank keeps of every rank's sequences, to judge commands alike.

Owns the semantic validation of a decoded ``StepCommand`` and its bookkeeping. Invariants:
every rank holds an identical mirror (same commands, applied in the same order), so every
rank reaches the same verdict on the same bytes; ``validate`` changes nothing and raises
``EpCommandFailed`` naming the first problem; ``apply`` runs only after a passing
``validate``; step ids rise by one per command received, valid or not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from epserve.models.traits import EpCommandFailed
from epserve.worker.protocol import (
    FEED_DEVICE, KIND_SHUTDOWN, KIND_STEP, NewSeq, Sampling, StepCommand,
)

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SlotInfo:
    """What every rank knows of one live sequence."""

    seq_len: int
    num_blocks: int
    prompt_len: int
    prompt_logprobs: int
    sampling: Sampling


class EpMirror:
    """All ranks' live sequences, keyed by ``(rank, slot)``."""

    def __init__(self, world_size: int, num_blocks: int, block_size: int, max_slots: int,
                 max_blocks_per_seq: int, vocab_size: int):
        self.world_size = world_size
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_slots = max_slots
        self.max_blocks_per_seq = max_blocks_per_seq
        self.vocab_size = vocab_size
        self.slots: dict[tuple[int, int], SlotInfo] = {}
        self.next_step = 0

    # ------------------------------------------------------------------ validate

    def validate(self, cmd: StepCommand) -> None:
        """Raise ``EpCommandFailed`` if ``cmd`` cannot run; consumes its step id either way."""
        expected = self.next_step
        self.next_step += 1
        fail = _Failer(cmd.step_id)
        if cmd.step_id != expected:
            fail(f"step id {cmd.step_id}, expected {expected}")
        if cmd.kind not in (KIND_STEP, KIND_SHUTDOWN):
            fail(f"unknown command kind {cmd.kind}")
        live = set(self.slots)
        for r in cmd.releases:
            key = self._key(r.rank, r.slot, fail, "release")
            if key not in live:
                fail(f"release of unknown sequence {key}")
            live.discard(key)
        for n in cmd.new_seqs:
            self._check_new(n, live, fail)
            live.add((n.rank, n.slot))
        for u in cmd.sampling_updates:
            self._live(u.rank, u.slot, live, fail, "sampling update")
            self._check_sampling(u.sampling, fail)
        blocks = self._check_blocks(cmd, live, fail)
        self._check_rows(cmd, live, blocks, fail)

    def _key(self, rank: int, slot: int, fail: "_Failer", what: str) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            fail(f"{what}: rank {rank} out of range [0, {self.world_size})")
        if not 0 <= slot < self.max_slots:
            fail(f"{what}: slot {slot} out of range [0, {self.max_slots})")
        return rank, slot

    def _live(self, rank: int, slot: int, live: set, fail: "_Failer", what: str) -> tuple[int, int]:
        key = self._key(rank, slot, fail, what)
        if key not in live:
            fail(f"{what}: unknown sequence {key}")
        return key

    def _check_new(self, n: NewSeq, live: set, fail: "_Failer") -> None:
        key = self._key(n.rank, n.slot, fail, "new sequence")
        if key in live:
            fail(f"new sequence {key} is already live")
        if n.seq_len < 0 or n.prompt_len < 1:
            fail(f"new sequence {key}: seq_len {n.seq_len}, prompt_len {n.prompt_len}")
        if not -1 <= n.prompt_logprobs <= MAX_LOGPROBS:
            fail(f"new sequence {key}: prompt_logprobs {n.prompt_logprobs}")
        self._check_sampling(n.sampling, fail)

    def _check_sampling(self, s: Sampling, fail: "_Failer") -> None:
        if not (math.isfinite(s.temperature) and s.temperature >= 0):
            fail(f"sampling: temperature {s.temperature}")
        if not (0 < s.top_p <= 1):
            fail(f"sampling: top_p {s.top_p}")
        if not 0 <= s.top_k <= self.vocab_size:
            fail(f"sampling: top_k {s.top_k}")
        if not 0 <= s.min_p <= 1:
            fail(f"sampling: min_p {s.min_p}")
        if not 0 <= s.seed < 2**64:
            fail(f"sampling: seed {s.seed}")
        if not -1 <= s.logprobs <= MAX_LOGPROBS:
            fail(f"sampling: logprobs {s.logprobs}")
        if any(not 0 <= t < self.vocab_size for t in s.banned):
            fail("sampling: banned token outside the vocab")

    def _check_blocks(self, cmd: StepCommand, live: set, fail: "_Failer") -> dict:
        counts = {k: v.num_blocks for k, v in self.slots.items()}
        for n in cmd.new_seqs:
            counts[(n.rank, n.slot)] = 0
        for b in cmd.block_updates:
            key = self._live(b.rank, b.slot, live, fail, "block update")
            if b.first != counts[key]:
                fail(f"block update for {key} starts at {b.first}, the table has {counts[key]}")
            if b.first + len(b.blocks) > self.max_blocks_per_seq:
                fail(f"block update for {key}: {b.first + len(b.blocks)} blocks exceed "
                     f"{self.max_blocks_per_seq}")
            if any(not 0 <= x < self.num_blocks for x in b.blocks):
                fail(f"block update for {key}: block id out of range [0, {self.num_blocks})")
            counts[key] = b.first + len(b.blocks)
        return counts

    def _check_rows(self, cmd: StepCommand, live: set, blocks: dict, fail: "_Failer") -> None:
        seen: set = set()
        lens = {k: v.seq_len for k, v in self.slots.items()}
        lens.update({(n.rank, n.slot): n.seq_len for n in cmd.new_seqs})
        bs, vocab = self.block_size, self.vocab_size
        for d in cmd.decode:
            key = self._live(d.rank, d.slot, live, fail, "decode row")
            if key in seen:
                fail(f"decode row: sequence {key} appears twice")
            seen.add(key)
            if d.feed != FEED_DEVICE and not 0 <= d.feed < vocab:
                fail(f"decode row {key}: token {d.feed} outside the vocab")
            if lens[key] >= blocks[key] * bs or d.output_index < 0:
                fail(f"decode row {key}: no KV block for position {lens[key]}")
        for p in cmd.prefill:
            key = self._live(p.rank, p.slot, live, fail, "prefill row")
            if key in seen:
                fail(f"prefill row: sequence {key} appears twice")
            seen.add(key)
            if p.start != lens[key] or not p.tokens or p.output_index < 0:
                fail(f"prefill row {key}: chunk at {p.start} of {len(p.tokens)} tokens, the "
                     f"sequence has KV for {lens[key]}")
            if p.start + len(p.tokens) > blocks[key] * bs:
                fail(f"prefill row {key}: no KV block for position {p.start + len(p.tokens) - 1}")
            if any(not 0 <= t < vocab for t in p.tokens) or not -1 <= p.next_token < vocab:
                fail(f"prefill row {key}: token outside the vocab")

    # ------------------------------------------------------------------ apply

    def apply(self, cmd: StepCommand) -> None:
        """Record a validated command's effects (identically on every rank)."""
        for r in cmd.releases:
            del self.slots[(r.rank, r.slot)]
        for n in cmd.new_seqs:
            self.slots[(n.rank, n.slot)] = SlotInfo(n.seq_len, 0, n.prompt_len,
                                                    n.prompt_logprobs, n.sampling)
        for u in cmd.sampling_updates:
            self.slots[(u.rank, u.slot)].sampling = u.sampling
        for b in cmd.block_updates:
            self.slots[(b.rank, b.slot)].num_blocks = b.first + len(b.blocks)
        for d in cmd.decode:
            self.slots[(d.rank, d.slot)].seq_len += 1
        for p in cmd.prefill:
            self.slots[(p.rank, p.slot)].seq_len = p.start + len(p.tokens)


class _Failer:
    """Raises the command's ``EpCommandFailed`` with a reason."""

    def __init__(self, step_id: int):
        self.step_id = step_id

    def __call__(self, reason: str) -> None:
        raise EpCommandFailed(self.step_id, reason)
