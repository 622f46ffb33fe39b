"""What a rank sends back after a step: its sampled tokens and new prompt logprobs (msgpack).

Invariants: nothing is pickled; a frame is ``[PROTOCOL_VERSION, step_id, rank, sampled,
sampled alternatives, prompt logprobs, their alternatives, verified, their alternatives,
drafts, their ids]`` read against that layout (``worker.wire``) with the same strict types as
commands: fixed-width records (slot, token and rank int64, logprob float64; rank 0 is no rank,
a negative one refused), sampled tokens sorted by slot (each slot once), prompt logprobs grouped
by slot (slots rising, positions in order), at most the engine's ``max_logprobs``
alternatives an entry (``WireLimits.max_logprobs``; ``MAX_LOGPROBS`` without limits);
anything else is a ``ProtocolError``. A decoded result keeps the records and builds
``SampledToken`` / ``PromptTokenLogprob`` objects only for the slots read, so decoding costs at
most about 2x the frame's size in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from epserve.models.sampling_rules import MAX_LOGPROBS
from epserve.models.traits import PromptTokenLogprob, SampledToken
from epserve.worker.step_command import (
    MAX_DRAFT_TOKENS, MAX_FRAME_BYTES, PROTOCOL_VERSION, ProtocolError, WireLimits,
)
from epserve.worker.wire import (
    F64, I64, Table, TableSpec, decode_table, encode_table, ids_spec, pack_frame, read_fields,
)


@dataclass(frozen=True, slots=True)
class RankResult:
    """``sampled``: slot -> token for every sampled row of this rank; ``prompt_logprobs``:
    slot -> the prompt positions scored in this step; ``verified``: slot -> the target's
    token at each position of a verify row; ``drafts``: slot -> the tokens the model's MTP
    head proposes after the slot's last sampled token (``worker.mtp_drafter``). Dicts when
    built by the rank, read-only mappings over the records when decoded (equal either way)."""

    step_id: int
    rank: int
    sampled: Mapping[int, SampledToken]
    prompt_logprobs: Mapping[int, Sequence[PromptTokenLogprob]]
    verified: Mapping[int, Sequence[SampledToken]] = field(default_factory=dict)
    drafts: Mapping[int, Sequence[int]] = field(default_factory=dict)


_TOP = np.dtype([("token", I64), ("logprob", F64)])
_ENTRY = np.dtype([("slot", I64), ("token", I64), ("logprob", F64), ("rank", I64), ("n", I64)])


def _pack_top(tops: list) -> np.ndarray:
    return np.array([p for top in tops for p in top], dtype=_TOP)


def _entries(name: str, make: type) -> TableSpec:
    """Slot-keyed (token, logprob, rank, alternatives) rows of ``make`` (``SampledToken`` or
    ``PromptTokenLogprob``; a rank of None travels as 0). The rank's sampler may hand numpy or
    torch scalars: the records take them as int and float, as msgpack did."""
    return TableSpec(name, _ENTRY, lambda e: (e[0], int(e[1].token_id), float(e[1].logprob),
                                              int(e[1].rank or 0)),
                     lambda v, top: make(v[1], v[2], tuple(top.tolist()), v[3] or None),
                     flat=_TOP, extra=lambda e: e[1].top, pack_flat=_pack_top)


def _ranked(table: Table) -> Table:
    """``table``, refused when a record's rank is negative (0: none; a rank counts tokens)."""
    if len(table) and table.recs["rank"].min() < 0:
        raise ProtocolError(f"{table.spec.name}: a negative rank")
    return table


SAMPLED = _entries("sampled", SampledToken)
PROMPT = _entries("prompt_logprobs", PromptTokenLogprob)
VERIFIED = _entries("verified", SampledToken)
DRAFTS = ids_spec("drafts", [("slot", I64)], "i", lambda e: (e[0],), lambda e: e[1],
                  lambda v, ids: tuple(ids))
_LAYOUT = "iii" + "b" * 8
_FRAME_SLACK = 4096  # the frame's header and its bins' length prefixes, with room to spare


def max_logprobs_in_frame(entries: int) -> int:
    """The most alternatives per entry with which ``entries`` entries (a step's tokens) still
    fit one result frame."""
    return max(0, ((MAX_FRAME_BYTES - _FRAME_SLACK) // max(entries, 1) - _ENTRY.itemsize)
               // _TOP.itemsize)
_CACHE_ROWS = 4096  # rows a result keeps once read: ~1 MiB with no alternatives, ~11 with 20


class BySlot(Mapping):
    """slot -> its row (``unique``) or its list of rows, from records sorted by slot. Up to
    ``_CACHE_ROWS`` rows are built on the first read and kept (the leader reads every slot it
    scheduled, ~0.5 us each); beyond that each read builds its own rows (a binary search, ~3 us),
    so no frame's rows all become objects at once."""

    __slots__ = ("table", "slots", "unique", "_len", "_cache")

    def __init__(self, table: Table, unique: bool):
        slots = np.ascontiguousarray(table.recs["slot"])  # searched per lookup: keep it dense
        rising = slots[1:] > slots[:-1]
        if not (rising if unique else rising | (slots[1:] == slots[:-1])).all():
            raise ProtocolError(f"{table.spec.name}: slots out of order"
                                + (" or repeated" if unique else ""))
        self.table, self.slots, self.unique = table, slots, unique
        self._len = len(slots) if unique or not len(slots) else 1 + int(rising.sum())
        self._cache: dict | None = None

    def __getitem__(self, slot: int):
        if self._cache is None and len(self.slots) <= _CACHE_ROWS:
            self._cache = self._build()
        if self._cache is not None:
            got = self._cache[slot]
            return got if self.unique else list(got)
        if type(slot) is not int or not -(2**63) <= slot < 2**63:
            raise KeyError(slot)
        lo = int(self.slots.searchsorted(slot, "left"))
        hi = int(self.slots.searchsorted(slot, "right"))
        if lo == hi:
            raise KeyError(slot)
        return self.table[lo] if self.unique else list(self.table[lo:hi])

    def _build(self) -> dict:
        if self.unique:
            return dict(zip(self.slots.tolist(), self.table))
        out: dict = {}
        for slot, row in zip(self.slots.tolist(), self.table):
            out.setdefault(slot, []).append(row)
        return out

    def __iter__(self) -> Iterator[int]:
        last = None
        for lo in range(0, len(self.slots), 1024):
            for s in self.slots[lo:lo + 1024].tolist():
                if s != last:
                    yield s
                last = s

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"BySlot({dict(self.items())!r})"


def encode_result(res: RankResult) -> bytes:
    """The frame for ``res``; ``ProtocolError`` if a value does not fit its record or the frame
    would exceed ``MAX_FRAME_BYTES``."""
    sampled = sorted(res.sampled.items())
    prompt = [(slot, e) for slot, entries in sorted(res.prompt_logprobs.items())
              for e in entries]
    verified = [(slot, e) for slot, entries in sorted(res.verified.items()) for e in entries]
    if type(res.step_id) is not int or type(res.rank) is not int:
        raise ProtocolError("result: step_id and rank must be ints")
    body = [PROTOCOL_VERSION, res.step_id, res.rank, *encode_table(SAMPLED, sampled),
            *encode_table(PROMPT, prompt), *encode_table(VERIFIED, verified),
            *encode_table(DRAFTS, sorted(res.drafts.items()))]
    return pack_frame(body, MAX_FRAME_BYTES, "result frame")


def decode_result(frame: bytes, limits: WireLimits | None = None) -> RankResult:
    """The ``RankResult`` in ``frame``; ``ProtocolError`` for anything malformed or, with
    ``limits``, more sampled tokens than slots or more prompt positions than the step's
    token budget."""
    f = read_fields(frame, _LAYOUT, PROTOCOL_VERSION, MAX_FRAME_BYTES, "result frame")
    slots, tokens = (None, None) if limits is None else (limits.max_slots, limits.max_step_tokens)
    k = MAX_LOGPROBS if limits is None else limits.max_logprobs
    try:
        sampled = _ranked(decode_table(SAMPLED, f[3], f[4], slots, k))
        prompt = _ranked(decode_table(PROMPT, f[5], f[6], tokens, k))
        verified = _ranked(decode_table(VERIFIED, f[7], f[8], None if slots is None
                                        else slots * (MAX_DRAFT_TOKENS + 1), k))
        drafts = decode_table(DRAFTS, f[9], f[10], slots, MAX_DRAFT_TOKENS)
        return RankResult(f[1], f[2], BySlot(sampled, True), BySlot(prompt, False),
                          BySlot(verified, False), BySlot(drafts, True))
    except ProtocolError:
        raise
    except Exception as exc:  # defensive: no other exception type may escape
        raise ProtocolError(f"malformed result frame: {type(exc).__name__}: {exc}") from None
