"""What the ranks know of each live sequence, seen from rank 0, and what a command must add.

``RankView`` holds, per ``(rank, slot)``, the block count and sampling the ranks were sent and
the token the slot sampled last; ``Shipment`` turns one step's rows into the command's
sequence updates (new sequences, block updates, sampling updates) and decode columns.
Invariants: the view changes only once a command ran on every rank (``Shipment.commit``); a
freed sequence is forgotten at once, so a new sequence in its slot is shipped whole; a decode
row's fed token travels as ``FEED_DEVICE`` when it is the one its rank sampled last. A step's
decode rows are handled as columns, and the rows that ran in the last step and run again, fed
what they sampled, travel as a repeat (``StepCommand.repeat``): a steady batch of 256 decode
rows costs a few list comparisons and no per-row bytes. ``RankView.rows`` is what a repeat
refers to: the last step's decode rows as every rank applied them, None when it is not known
(the step failed, verified, or no step ran since), and then rows travel explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Any, Sequence

from epserve.models.traits import SequenceState
from epserve.worker.step_command import (
    FEED_DEVICE, BlockUpdate, DecodeRows, NewSeq, SamplingUpdate,
)

_SLOT, _OUTPUT_INDEX = attrgetter("slot_idx"), attrgetter("output_index")
_SAMPLING = attrgetter("sampling")
_NEXT = (1).__add__
_UNKNOWN = -1  # block count of a slot whose sequence the ranks do not know
_NO_TOKEN = -2  # last token of a slot that has sampled none (never equals a fed token)


@dataclass(frozen=True, slots=True)
class SentRows:
    """A command's decode rows in the ranks' order: their sequences, output indices and
    sampling as sent, and (once the step ran) the token each sampled (``tokens``)."""

    seqs: Sequence[SequenceState]
    output_index: list[int]
    sampling: list[Any]
    tokens: list[int] | None = None


class RankView:
    """Rank 0's record of what every rank was sent, over ``world_size * max_slots`` slots."""

    def __init__(self, world_size: int, max_slots: int):
        self.world_size, self.max_slots = world_size, max_slots
        n = world_size * max_slots
        # plain lists: a step reads them once per row in a list comprehension, cheaper than
        # numpy calls on a few hundred values
        self.nblocks = [_UNKNOWN] * n
        self.sampling: list[Any] = [None] * n
        self.last_token = [_NO_TOKEN] * n
        self.pending_releases: set[tuple[int, int]] = set()
        # (rank, slot) -> (seq_len, nblocks) the ranks must rewind to (after a verify)
        self.pending_rewinds: dict[tuple[int, int], tuple[int, int]] = {}
        self.rows: SentRows | None = None  # the last step's decode rows, as the ranks hold them

    def flat(self, seq: SequenceState) -> int:
        return seq.rank * self.max_slots + seq.slot_idx

    def forget(self, rank: int, slot: int, known: bool) -> None:
        """The sequence in ``(rank, slot)`` was freed; ``known``: the ranks hold it and must be
        told to release it."""
        if known:
            self.pending_releases.add((rank, slot))
        self.pending_rewinds.pop((rank, slot), None)
        f = rank * self.max_slots + slot
        self.nblocks[f] = _UNKNOWN
        self.sampling[f] = None
        self.last_token[f] = _NO_TOKEN

    def rewound(self, seq: SequenceState) -> None:
        """``seq`` keeps fewer tokens (and maybe blocks) than the ranks hold for it: tell them
        with the next command."""
        self.pending_rewinds[(seq.rank, seq.slot_idx)] = (seq.seq_len, len(seq.block_table))
        self.nblocks[self.flat(seq)] = len(seq.block_table)

    def feed(self, seq: SequenceState, token: int) -> int:
        """The token a row feeds ``seq``, as it travels: ``FEED_DEVICE`` when it is the one
        the slot sampled last."""
        return FEED_DEVICE if self.last_token[self.flat(seq)] == token else token

    def sampled(self, flats: Sequence[int], tokens: Sequence[int]) -> None:
        """The tokens these slots sampled in the step that just ran."""
        last = self.last_token
        for f, t in zip(flats, tokens):
            last[f] = t


class Shipment:
    """What one command tells the ranks about the sequences its rows name."""

    def __init__(self, view: RankView):
        self.view = view
        self.new: list[NewSeq] = []
        self.sampling: list[SamplingUpdate] = []
        self.blocks: list[BlockUpdate] = []
        self._sampling_sent: dict[int, Any] = {}
        self._blocks_sent: dict[int, int] = {}

    def decode_rows(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                    grown: Sequence[SequenceState] = ()) -> DecodeRows:
        """The explicit decode columns (rank, slot, feed, output index), shipping what each
        row's sequence needs first; the leading rows that repeat the last step's are not among
        them (``repeat``, ``dropped``, ``kept``). ``grown``: sequences whose block tables grew
        since the last committed command (the KV book's log): a kept row's new blocks are
        found there instead of by looking at every row."""
        self.repeat, self.dropped, self.kept = False, (), 0
        if not seqs:
            self.sent = None
            return DecodeRows()
        oidx = list(map(_OUTPUT_INDEX, seqs))
        prev = self.view.rows
        k = self._repeat(prev, tokens, seqs, oidx) if prev else 0
        if k == len(seqs) and not self.dropped and all(
                map(is_, map(_SAMPLING, seqs), prev.sampling)):
            samp = prev.sampling  # all rows again, none with a new sampling: the same list
        else:
            samp = list(map(_SAMPLING, seqs))
        self.sent = SentRows(tuple(seqs), oidx, samp)
        if k:
            view, flat = self.view, self.view.flat
            for s in grown:  # new blocks of sequences the ranks know (kept rows among them)
                if s.slot_idx >= 0 and _UNKNOWN != view.nblocks[flat(s)] < len(s.block_table):
                    self.sequence(s)
            if samp is not prev.sampling and not all(map(is_, samp[:k], self._kept_sampling)):
                for s in seqs[:k]:  # a changed sampling (rare)
                    self.sequence(s)
            if k == len(seqs):
                return DecodeRows()
            tokens, seqs, oidx = tokens[k:], seqs[k:], oidx[k:]
        return self._explicit(tokens, seqs, oidx)

    def _repeat(self, prev: SentRows, tokens: Sequence[int], seqs: Sequence[SequenceState],
                oidx: list[int]) -> int:
        """How many leading rows repeat ``prev``'s (the same sequences in the same order, each
        fed what it sampled, at its next output index); sets ``repeat``, ``dropped``."""
        ps, pt, po = prev.seqs, prev.tokens, prev.output_index
        if len(ps) == len(seqs) and all(map(is_, ps, seqs)):
            keep, k = None, len(ps)
        else:  # rows left (finished, preempted, verified): drop them, keep the others' order
            now = set(map(id, seqs))
            keep = [id(s) in now for s in ps]
            k = sum(keep)
            if not k or len(seqs) < k or not all(
                    map(is_, (s for s, m in zip(ps, keep) if m), seqs[:k])):
                return 0
            pt = [t for t, m in zip(pt, keep) if m]
            po = [o for o, m in zip(po, keep) if m]
        if (tokens if k == len(tokens) else list(tokens[:k])) != pt or (
                oidx if k == len(oidx) else oidx[:k]) != list(map(_NEXT, po)):
            return 0
        self.repeat, self.kept = True, k
        self.dropped = () if keep is None else tuple(i for i, m in enumerate(keep) if not m)
        self._kept_sampling = (prev.sampling if keep is None else
                               [x for x, m in zip(prev.sampling, keep) if m])
        return k

    def _explicit(self, tokens: Sequence[int], seqs: Sequence[SequenceState],
                  oidx: list[int]) -> DecodeRows:
        view = self.view
        ms = view.max_slots
        if view.world_size == 1:
            flat = list(map(_SLOT, seqs))
        else:
            flat = [s.rank * ms + s.slot_idx for s in seqs]
        nb, samp, last = view.nblocks, view.sampling, view.last_token
        # new blocks, a new sequence or a changed sampling
        for s in [s for s, x in zip(seqs, flat)
                  if len(s.block_table) != nb[x] or s.sampling is not samp[x]]:
            self.sequence(s)
        feed = [FEED_DEVICE if last[x] == t else t for x, t in zip(flat, tokens)]
        if view.world_size == 1:
            return DecodeRows.of([0] * len(flat), flat, feed, oidx)
        return DecodeRows.of([x // ms for x in flat], [x % ms for x in flat], feed, oidx)

    def ran(self, tokens: list[int] | None) -> None:
        """The step ran on every rank and its decode rows sampled ``tokens`` (None: not known,
        e.g. a row failed or verified): what the next command's repeat refers to."""
        self.view.rows = (None if tokens is None or self.sent is None
                          else SentRows(self.sent.seqs, self.sent.output_index,
                                        self.sent.sampling, tokens))

    def sequence(self, seq: SequenceState) -> None:
        """Ship what the ranks do not know of ``seq`` yet: all of it once, then new blocks and
        a changed sampling (once per command: a second call ships only what changed since)."""
        view = self.view
        f = view.flat(seq)
        shipped = self._blocks_sent.get(f)
        if shipped is None:
            shipped = view.nblocks[f]
        if shipped == _UNKNOWN:
            self.new.append(NewSeq(seq.rank, seq.slot_idx, seq.seq_len, max(seq.prompt_len, 1),
                                   -1 if seq.collect_prompt_logprobs is None
                                   else seq.collect_prompt_logprobs, seq.sampling))
            self._sampling_sent[f] = seq.sampling
            shipped = 0
            self._blocks_sent[f] = 0
        elif self._sampling_sent.get(f, view.sampling[f]) is not seq.sampling:
            self.sampling.append(SamplingUpdate(seq.rank, seq.slot_idx, seq.sampling))
            self._sampling_sent[f] = seq.sampling
        n = len(seq.block_table)
        if n > shipped:
            self.blocks.append(BlockUpdate(seq.rank, seq.slot_idx, shipped,
                                           tuple(seq.block_table[shipped:])))
            self._blocks_sent[f] = n

    def commit(self, releases: Sequence[Any], rewinds: Sequence[Any] = ()) -> None:
        """Every rank ran the command: what it shipped (and released) is known everywhere."""
        view = self.view
        view.pending_releases.difference_update((r.rank, r.slot) for r in releases)
        for r in rewinds:
            if view.pending_rewinds.get((r.rank, r.slot)) == (r.seq_len, r.nblocks):
                del view.pending_rewinds[(r.rank, r.slot)]
        for f, s in self._sampling_sent.items():
            view.sampling[f] = s
        for f, n in self._blocks_sent.items():
            view.nblocks[f] = n
