"""EpMirror: the state every rank keeps of every rank's sequences, to judge commands alike.

Owns the semantic validation of a decoded ``StepCommand`` and its bookkeeping. Invariants:
every rank holds an identical mirror (same commands, applied in the same order), so every
rank reaches the same verdict on the same bytes; ``validate`` changes nothing and raises
``EpCommandFailed`` naming the first problem and, when one sequence's rows or updates caused
it, that sequence's ``(rank, slot)`` (so the leader can drop just it and re-issue the step);
sampling values are judged by ``models.sampling_rules``, the rule the head applies at the edge;
``apply`` runs only after a passing ``validate`` of the same command (it reuses the decode rows
validate resolved, a repeat's base next); step ids rise by one per command received, valid or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from epserve.models.sampling_rules import MAX_LOGPROBS, penalized, row_sampling_problem
from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker.step_command import (
    FEED_DEVICE, KIND_DECODE_AHEAD, KIND_SHUTDOWN, KIND_STEP, MAX_DRAFT_TOKENS, Ints, NewSeq,
    StepCommand,
)


@dataclass(slots=True)
class SlotInfo:
    """What every rank knows of one live sequence (its KV length and block count live in the
    mirror's arrays, where a step's decode rows are checked and advanced in one go)."""

    prompt_len: int
    prompt_logprobs: int
    sampling: RowSampling


class EpMirror:
    """All ranks' live sequences, keyed by ``(rank, slot)``."""

    def __init__(self, world_size: int, num_blocks: int, block_size: int, max_slots: int,
                 max_blocks_per_seq: int, vocab_size: int, lookahead: bool = False,
                 max_logprobs: int = MAX_LOGPROBS, recurrent: bool = False):
        """``lookahead``: the rank can run ``KIND_DECODE_AHEAD`` steps (one rank, a runner
        with the decode lookahead); elsewhere such a step is refused. ``max_logprobs``: the
        engine's bound on a row's logprobs and prompt logprobs. ``recurrent``: the model
        keeps recurrent state per sequence (gated DeltaNet), which exists only for the tokens
        the rank ran: a new sequence starts with no KV, and a rewind only follows a verify
        (the next applied command; to a length inside the verified window: the rank folded
        the accepted prefix into the state, the rewind drops the rest's KV)."""
        self.world_size = world_size
        self.recurrent = recurrent
        self.max_logprobs = max_logprobs
        self.lookahead = lookahead
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_slots = max_slots
        self.max_blocks_per_seq = max_blocks_per_seq
        self.vocab_size = vocab_size
        self.slots: dict[tuple[int, int], SlotInfo] = {}
        self.live = np.zeros((world_size, max_slots), dtype=bool)
        self.seq_len = np.zeros((world_size, max_slots), dtype=np.int64)
        self.nblocks = np.zeros((world_size, max_slots), dtype=np.int64)
        self.next_step = 0
        # the last validated command's decode rows (a repeat's kept rows first): flat keys,
        # positions (KV lengths), output indices, and fed tokens (None: all ``FEED_DEVICE``)
        self.decode_keys = self.decode_pos = self.decode_oidx = _NO_ROWS
        self.decode_feed: np.ndarray | None = None
        # the last applied command's decode rows, which a repeat runs again
        self.rows_keys = self.rows_oidx = _NO_ROWS
        self.verify_pos: list[int] = []  # and each verify row's first position
        # the last applied command's verify rows: (rank, slot) -> (first position, end)
        self.verified: dict[tuple[int, int], tuple[int, int]] = {}

    def num_blocks_of(self, key: tuple[int, int]) -> int:
        return int(self.nblocks[key])

    def kept_rows(self, cmd: StepCommand) -> list[tuple[int, int]]:
        """The sequences of ``cmd``'s repeated decode rows, in order (none without a repeat)."""
        drop, ms = {int(i) for i in cmd.dropped}, self.max_slots
        return [divmod(k, ms) for i, k in enumerate(self.rows_keys.tolist()) if i not in drop
                ] if cmd.repeat else []

    # ------------------------------------------------------------------ validate

    def validate(self, cmd: StepCommand) -> None:
        """Raise ``EpCommandFailed`` if ``cmd`` cannot run; consumes its step id either way."""
        expected = self.next_step
        self.next_step += 1
        fail = _Failer(cmd.step_id)
        if cmd.step_id != expected:
            fail(f"step id {cmd.step_id}, expected {expected}")
        if cmd.kind not in (KIND_STEP, KIND_SHUTDOWN, KIND_DECODE_AHEAD):
            fail(f"unknown command kind {cmd.kind}")
        if cmd.kind == KIND_DECODE_AHEAD and not self.lookahead:
            fail("a decode-ahead step, but this rank runs no decode lookahead")
        if cmd.kind == KIND_DECODE_AHEAD and cmd.verify:
            fail("a decode-ahead step with verify rows")
        # the arrays are copied only where the command changes them (validate changes nothing)
        live = self.live.copy() if cmd.releases or cmd.new_seqs else self.live
        for r in cmd.releases:
            key = self._key(r.rank, r.slot, fail, "release")
            if not live[key]:
                fail(f"release of unknown sequence {key}")
            live[key] = False
        for n in cmd.new_seqs:
            self._check_new(n, live, fail)
            live[n.rank, n.slot] = True
        for u in cmd.sampling_updates:
            key = self._live(u.rank, u.slot, live, fail, "sampling update")
            self._check_sampling(u.sampling, fail, key)
        lens = self.seq_len.copy() if cmd.new_seqs or cmd.rewinds else self.seq_len
        for n in cmd.new_seqs:
            lens[n.rank, n.slot] = n.seq_len
        blocks = self._check_blocks(cmd, live, lens, fail)
        self._check_rows(cmd, live, blocks, lens, fail)

    def _key(self, rank: int, slot: int, fail: "_Failer", what: str) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            fail(f"{what}: rank {rank} out of range [0, {self.world_size})")
        if not 0 <= slot < self.max_slots:
            fail(f"{what}: slot {slot} out of range [0, {self.max_slots})")
        return rank, slot

    def _live(self, rank: int, slot: int, live: np.ndarray, fail: "_Failer",
              what: str) -> tuple[int, int]:
        key = self._key(rank, slot, fail, what)
        if not live[key]:
            fail(f"{what}: unknown sequence {key}", key)
        return key

    def _first_row(self, rank: int, slot: int, live: np.ndarray, seen: set[int],
                   fail: "_Failer", what: str) -> tuple[int, int]:
        """The key of a live sequence's row, which must be its only row of the step (``seen``:
        the flat keys of the rows before it; this one is added)."""
        key = self._live(rank, slot, live, fail, what)
        flat = rank * self.max_slots + slot
        if flat in seen:
            fail(f"{what}: sequence {key} appears twice", key)
        seen.add(flat)
        return key

    def _check_new(self, n: NewSeq, live: np.ndarray, fail: "_Failer") -> None:
        key = self._key(n.rank, n.slot, fail, "new sequence")
        if live[key]:
            fail(f"new sequence {key} is already live")
        if self.recurrent and n.seq_len:
            fail(f"new sequence {key} with KV for {n.seq_len} tokens: this model keeps "
                 f"recurrent state, which starts from the sequence's first token", key)
        if n.seq_len and penalized(n.sampling):
            fail(f"new sequence {key} with KV for {n.seq_len} tokens and sampling penalties: "
                 f"its rank needs every prompt token", key)
        if n.seq_len < 0 or n.prompt_len < 1:
            fail(f"new sequence {key}: seq_len {n.seq_len}, prompt_len {n.prompt_len}", key)
        if not -1 <= n.prompt_logprobs <= self.max_logprobs:
            fail(f"new sequence {key}: prompt_logprobs {n.prompt_logprobs}", key)
        self._check_sampling(n.sampling, fail, key)

    def _check_sampling(self, s: RowSampling, fail: "_Failer", key: tuple[int, int]) -> None:
        found = row_sampling_problem(s.temperature, s.top_p, s.top_k, s.min_p, s.seed,
                                     s.logprobs, s.banned_token_ids, self.vocab_size,
                                     s.logit_bias, self.max_logprobs,
                                     (s.presence_penalty, s.frequency_penalty,
                                      s.repetition_penalty))
        if found is not None:
            fail(f"sampling of {key}: {found[0]} {found[1]}", key)

    def _check_blocks(self, cmd: StepCommand, live: np.ndarray, lens: np.ndarray,
                      fail: "_Failer") -> np.ndarray:
        """Block counts after the command's rewinds and block updates (``lens``: KV lengths,
        rewound here)."""
        counts = (self.nblocks.copy() if cmd.releases or cmd.new_seqs or cmd.block_updates
                  or cmd.rewinds else self.nblocks)
        for r in cmd.releases:  # invariant: a slot that is not live has no blocks
            counts[r.rank, r.slot] = 0
        for n in cmd.new_seqs:
            counts[n.rank, n.slot] = 0
        for r in cmd.rewinds:  # back, never forward: to fewer tokens in fewer blocks
            key = self._live(r.rank, r.slot, live, fail, "rewind")
            if not (0 <= r.seq_len <= lens[key]
                    and -(-r.seq_len // self.block_size) <= r.nblocks <= counts[key]):
                fail(f"rewind of {key} to {r.seq_len} tokens in {r.nblocks} blocks: it has "
                     f"{lens[key]} tokens in {counts[key]} blocks", key)
            if self.recurrent:
                win = self.verified.get(key)
                if win is None or not win[0] < r.seq_len <= win[1]:
                    fail(f"rewind of {key} to {r.seq_len} tokens: its recurrent state can only "
                         f"go back inside the verify just run ("
                         f"{'none' if win is None else f'positions {win[0]}..{win[1] - 1}'})",
                         key)
            counts[key] = r.nblocks
            lens[key] = r.seq_len
        for b in cmd.block_updates:
            key = self._live(b.rank, b.slot, live, fail, "block update")
            if b.first != counts[key]:
                fail(f"block update for {key} starts at {b.first}, the table has {counts[key]}",
                     key)
            if b.first + len(b.blocks) > self.max_blocks_per_seq:
                fail(f"block update for {key}: {b.first + len(b.blocks)} blocks exceed "
                     f"{self.max_blocks_per_seq}", key)
            if any(not 0 <= x < self.num_blocks for x in b.blocks):
                fail(f"block update for {key}: block id out of range [0, {self.num_blocks})",
                     key)
            counts[key] = b.first + len(b.blocks)
        return counts

    def _check_rows(self, cmd: StepCommand, live: np.ndarray, blocks: np.ndarray,
                    lens: np.ndarray, fail: "_Failer") -> None:
        keys = self._check_decode(cmd, live, blocks, lens, fail)
        seen = set(keys.tolist()) if cmd.prefill or cmd.verify else set()
        self.verify_pos = self._check_verify(cmd, live, blocks, lens, seen, fail)
        if cmd.prefill:
            self._check_prefill(cmd, live, blocks, lens, seen, fail)
        if cmd.masks:
            self._check_masks(cmd, live, keys, fail)

    def _check_prefill(self, cmd: StepCommand, live: np.ndarray, blocks: np.ndarray,
                       lens: np.ndarray, seen: set[int], fail: "_Failer") -> None:
        bs, vocab = self.block_size, self.vocab_size
        for p in cmd.prefill:
            key = self._first_row(p.rank, p.slot, live, seen, fail, "prefill row")
            if p.start != lens[key] or not len(p.tokens) or p.output_index < 0:
                fail(f"prefill row {key}: chunk at {p.start} of {len(p.tokens)} tokens, the "
                     f"sequence has KV for {lens[key]}", key)
            if p.start + len(p.tokens) > blocks[key] * bs:
                fail(f"prefill row {key}: no KV block for position "
                     f"{p.start + len(p.tokens) - 1}", key)
            if any(not 0 <= t < vocab for t in p.tokens) or not -1 <= p.next_token < vocab:
                fail(f"prefill row {key}: token outside the vocab", key)

    def _check_verify(self, cmd: StepCommand, live: np.ndarray, blocks: np.ndarray,
                      lens: np.ndarray, seen: set[int], fail: "_Failer") -> list[int]:
        """Each verify row: a live sequence in no other row, 1..``MAX_DRAFT_TOKENS`` drafts,
        tokens in the vocab, a KV block for its last position. Returns each row's first
        position (the sequence's KV length)."""
        bs, vocab, out = self.block_size, self.vocab_size, []
        for v in cmd.verify:
            key = self._first_row(v.rank, v.slot, live, seen, fail, "verify row")
            k, at = len(v.drafts), int(lens[key])
            if not 1 <= k <= MAX_DRAFT_TOKENS or v.output_index < 0:
                fail(f"verify row {key}: {k} drafts (1..{MAX_DRAFT_TOKENS}), output index "
                     f"{v.output_index}", key)
            if not FEED_DEVICE <= v.feed < vocab or any(not 0 <= t < vocab for t in v.drafts):
                fail(f"verify row {key}: token outside the vocab", key)
            if at + k >= blocks[key] * bs:
                fail(f"verify row {key}: no KV block for position {at + k}", key)
            out.append(at)
        return out

    def _check_masks(self, cmd: StepCommand, live: np.ndarray, keys: np.ndarray,
                     fail: "_Failer") -> None:
        """Each token mask: a live sequence that samples in this step (a decode row or a
        prefill row with ``sample``), at most one mask each, ``ceil(vocab / 32)`` words, and
        at least one vocabulary token allowed (else the row could sample nothing)."""
        sampled = set(keys.tolist())
        sampled.update(p.rank * self.max_slots + p.slot for p in cmd.prefill if p.sample)
        nwords, seen = -(-self.vocab_size // 32), set()
        tail = self.vocab_size - (nwords - 1) * 32  # tokens in the last word
        tail_bits = (1 << tail) - 1
        for m in cmd.masks:
            key = self._live(m.rank, m.slot, live, fail, "token mask")
            flat = m.rank * self.max_slots + m.slot
            if flat not in sampled:
                fail(f"token mask for {key}: the sequence samples no token in this step", key)
            if flat in seen:
                fail(f"token mask for {key}: two masks", key)
            seen.add(flat)
            w = np.asarray(m.words)
            if w.ndim != 1 or len(w) != nwords:
                fail(f"token mask for {key}: {len(w)} words, the vocabulary needs {nwords}", key)
            if not (w[:-1].any() or int(w[-1]) & tail_bits):
                fail(f"token mask for {key}: no token of the vocabulary is allowed", key)

    def _check_decode(self, cmd: StepCommand, live: np.ndarray, blocks: np.ndarray,
                      lens: np.ndarray, fail: "_Failer") -> np.ndarray:
        """All decode rows at once, a repeat's kept rows first: their flat keys, kept with
        their positions, output indices and feeds (``decode_*``) for ``apply`` and the rank's
        rows. Whole-array calls (a step's host time is per-call overhead): a kept row was
        checked when it came (``_kept`` checks what this command changes of it); the explicit
        rows' bounds, duplicates, then each row's room for its token (a slot that is not live
        has no blocks). Only a failing check looks for the row to name (``_decode_problem``)."""
        cols = cmd.decode.cols
        keys, oidx, feed = self._kept(cmd, live, fail) if cmd.repeat else (_NO_ROWS,) * 3
        if cols.shape[1]:
            lo, hi = np.minimum.reduce(cols, 1).tolist(), np.maximum.reduce(cols, 1).tolist()
            if (lo[0] < 0 or hi[0] >= self.world_size or lo[1] < 0 or hi[1] >= self.max_slots
                    or lo[2] < FEED_DEVICE or hi[2] >= self.vocab_size or lo[3] < 0):
                self._decode_problem(cols, live, blocks, lens, fail)
            more = cols[1] if self.world_size == 1 else cols[0] * self.max_slots + cols[1]
            if len(keys):
                feed = np.concatenate([np.full(len(keys), FEED_DEVICE), cols[2]])
                keys, oidx = np.concatenate([keys, more]), np.concatenate([oidx, cols[3]])
            else:
                keys, oidx, feed = more, cols[3], cols[2]
            if np.bincount(keys).max() > 1:
                self._decode_problem(self._cols(keys, feed, oidx), live, blocks, lens, fail)
        ln = lens.ravel()[keys] if len(keys) else _NO_ROWS
        if len(keys) and (blocks.ravel()[keys] * self.block_size <= ln).any():
            self._decode_problem(self._cols(keys, feed, oidx), live, blocks, lens, fail)
        self.decode_keys, self.decode_pos, self.decode_oidx = keys, ln, oidx
        self.decode_feed = None if feed is _NO_ROWS else feed
        return keys

    def _kept(self, cmd: StepCommand, live: np.ndarray, fail: "_Failer") -> tuple:
        """A repeat's kept rows (keys, output indices, None feeds): the last applied ones
        less ``dropped`` (ascending indices), at their next output index, none released or new."""
        drop, n = cmd.dropped, len(self.rows_keys)
        keys, oidx = self.rows_keys, self.rows_oidx + 1
        if len(drop):
            d = (drop.array if isinstance(drop, Ints) else np.asarray(drop)).astype(np.int64)
            if not (0 <= d[0] and d[-1] < n and (np.diff(d) > 0).all()):
                fail(f"repeat: dropped rows {d[:8].tolist()} are not ascending indices into "
                     f"the {n} decode rows of the last step")
            keys, oidx = np.delete(keys, d), np.delete(oidx, d)
        if (cmd.releases or cmd.new_seqs) and len(keys):
            fresh = [n.rank * self.max_slots + n.slot for n in cmd.new_seqs]
            bad = ~live.ravel()[keys] | np.isin(keys, np.array(fresh, dtype=np.int64))
            if bad.any():
                k = int(keys[int(bad.argmax())])
                key = (k // self.max_slots, k % self.max_slots)
                fail(f"repeat: decode row of {key}, which this command releases or starts", key)
        return keys, oidx, None

    def _cols(self, keys: np.ndarray, feed: np.ndarray | None, oidx: np.ndarray) -> np.ndarray:
        """Decode rows as the four columns (rank, slot, feed, output index)."""
        return np.stack([keys // self.max_slots, keys % self.max_slots,
                         np.full(len(keys), FEED_DEVICE) if feed is None else feed, oidx])

    def _decode_problem(self, cols: np.ndarray, live: np.ndarray, blocks: np.ndarray,
                        lens: np.ndarray, fail: "_Failer") -> None:
        """Raise the ``EpCommandFailed`` that names the first bad decode row."""
        rank, slot, feed, oidx = cols
        bad = (rank < 0) | (rank >= self.world_size) | (slot < 0) | (slot >= self.max_slots)
        if bad.any():
            i = int(bad.argmax())
            fail(f"decode row {i}: rank {rank[i]} / slot {slot[i]} out of range")
        keys = rank * self.max_slots + slot
        alive = live.ravel()[keys]
        if not alive.all():
            i = int((~alive).argmax())
            fail(f"decode row {i}: unknown sequence ({rank[i]}, {slot[i]})",
                 _row_key(rank, slot, i))
        if int(np.bincount(keys).max()) > 1:
            fail("decode row: a sequence appears twice")
        bad = (feed < FEED_DEVICE) | (feed >= self.vocab_size)
        if bad.any():
            i = int(bad.argmax())
            fail(f"decode row {i}: token outside the vocab", _row_key(rank, slot, i))
        ln = lens.ravel()[keys]
        bad = (ln >= blocks.ravel()[keys] * self.block_size) | (oidx < 0)
        i = int(bad.argmax())
        fail(f"decode row {i}: no KV block for position {ln[i]} of ({rank[i]}, {slot[i]})",
             _row_key(rank, slot, i))

    # ------------------------------------------------------------------ apply

    def apply(self, cmd: StepCommand) -> None:
        """Record a validated command's effects (identically on every rank)."""
        for r in cmd.releases:
            del self.slots[(r.rank, r.slot)]
            self.seq_len[r.rank, r.slot] = self.nblocks[r.rank, r.slot] = 0
            self.live[r.rank, r.slot] = False
        for n in cmd.new_seqs:
            self.slots[(n.rank, n.slot)] = SlotInfo(n.prompt_len, n.prompt_logprobs, n.sampling)
            self.seq_len[n.rank, n.slot] = n.seq_len
            self.nblocks[n.rank, n.slot] = 0
            self.live[n.rank, n.slot] = True
        for r in cmd.rewinds:
            self.seq_len[r.rank, r.slot] = r.seq_len
            self.nblocks[r.rank, r.slot] = r.nblocks
        for u in cmd.sampling_updates:
            self.slots[(u.rank, u.slot)].sampling = u.sampling
        for b in cmd.block_updates:
            self.nblocks[b.rank, b.slot] = b.first + len(b.blocks)
        if len(self.decode_keys):  # each decode row's position, kept by validate, plus one
            self.seq_len.ravel()[self.decode_keys] = self.decode_pos + 1
        self.rows_keys, self.rows_oidx = self.decode_keys, self.decode_oidx  # a repeat's base
        self.verified = {}
        for v, at in zip(cmd.verify, self.verify_pos):  # KV is written at every position
            self.seq_len[v.rank, v.slot] = end = at + len(v.drafts) + 1
            self.verified[(v.rank, v.slot)] = (at, end)
        for p in cmd.prefill:
            self.seq_len[p.rank, p.slot] = p.start + len(p.tokens)


_NO_ROWS = np.zeros(0, dtype=np.int64)


def _row_key(rank: np.ndarray, slot: np.ndarray, i: int) -> tuple[int, int]:
    return int(rank[i]), int(slot[i])


class _Failer:
    """Raises the command's ``EpCommandFailed`` with a reason, and the ``(rank, slot)`` of the
    sequence whose row or update made the command invalid when there is one."""

    def __init__(self, step_id: int):
        self.step_id = step_id

    def __call__(self, reason: str, key: tuple[int, int] | None = None) -> None:
        raise EpCommandFailed(self.step_id, reason, bad_rows=() if key is None else (key,))
