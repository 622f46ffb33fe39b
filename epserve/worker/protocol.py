"""The EP step command: one msgpack frame per forward pass, leader to every rank.

Owns the wire schema (``StepCommand`` and its row types), its encoder, and a strict decoder.
Invariants: nothing is pickled; a frame is a msgpack array whose first element is the
``PROTOCOL_VERSION``; every field has one exact type (ints are ints, never bools); a frame
above ``MAX_FRAME_BYTES`` is refused on both ends; the decoder turns any malformed bytes into
``ProtocolError`` and nothing else. Semantic checks (known slots, block ranges, sampling
values) are not here: they need the ranks' state (``worker.ep_state``).

After a sequence's first appearance (``NewSeq``) only what changed travels: chunk tokens,
decode feeds (a token id, or ``FEED_DEVICE``: the token this rank sampled for the slot last
step), new block-table entries, sampling updates, releases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import msgpack
import numpy as np

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 2**20
FEED_DEVICE = -1  # a decode row's token is the one its rank sampled for the slot last step

KIND_STEP = 0
KIND_SHUTDOWN = 1


class ProtocolError(ValueError):
    """A frame that is not a well-formed StepCommand (the channel may be broken)."""


@dataclass(frozen=True, slots=True)
class Sampling:
    """A row's sampling on the wire (``models.traits.RowSampling``'s fields; logprobs -1=None)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    banned: tuple[int, ...]
    logprobs: int


@dataclass(frozen=True, slots=True)
class NewSeq:
    """A sequence's first appearance on ``rank`` in ``slot``: its whole state once.

    ``seq_len``: tokens whose KV already exists (prefix-cache hit); ``prompt_len``: for prompt
    logprob targets; ``prompt_logprobs``: top-k to collect, -1 for none."""

    rank: int
    slot: int
    seq_len: int
    prompt_len: int
    prompt_logprobs: int
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class SamplingUpdate:
    rank: int
    slot: int
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class BlockUpdate:
    """Block-table entries ``blocks`` placed from logical index ``first`` on."""

    rank: int
    slot: int
    first: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Release:
    rank: int
    slot: int


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One token for ``slot``: ``feed`` is a token id or ``FEED_DEVICE``."""

    rank: int
    slot: int
    feed: int
    output_index: int


class DecodeRows:
    """The decode rows as four int32 columns (rank, slot, feed, output_index): 256 rows are one
    4 KiB blob on the wire and numpy arrays on arrival, not 256 objects to build and check."""

    __slots__ = ("cols",)

    def __init__(self, cols: "np.ndarray | None" = None):
        c = np.zeros((4, 0), dtype=np.int64) if cols is None else np.asarray(cols, np.int64)
        if c.ndim != 2 or c.shape[0] != 4:
            raise ProtocolError(f"decode rows: expected 4 columns, got shape {c.shape}")
        self.cols = c

    @classmethod
    def of(cls, rank: Sequence[int], slot: Sequence[int], feed: Sequence[int],
           output_index: Sequence[int]) -> "DecodeRows":
        try:
            cols = np.array([rank, slot, feed, output_index], dtype=np.int64).reshape(4, -1)
        except (OverflowError, ValueError, TypeError) as exc:
            raise ProtocolError(f"decode rows: {exc}") from None
        if cols.size and (cols.min() < -(2**31) or cols.max() >= 2**31):
            raise ProtocolError("decode rows: a value does not fit in int32")
        return cls(cols)

    @classmethod
    def from_rows(cls, rows: Sequence[DecodeRow]) -> "DecodeRows":
        return cls.of([r.rank for r in rows], [r.slot for r in rows], [r.feed for r in rows],
                      [r.output_index for r in rows])

    def __len__(self) -> int:
        return self.cols.shape[1]

    def __iter__(self):
        for r, s, f, o in self.cols.T.tolist():
            yield DecodeRow(r, s, f, o)

    def __add__(self, other: "tuple[DecodeRow, ...] | DecodeRows") -> "DecodeRows":
        extra = other if isinstance(other, DecodeRows) else DecodeRows.from_rows(other)
        return DecodeRows(np.concatenate([self.cols, extra.cols], axis=1))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple):
            other = DecodeRows.from_rows(other)
        return isinstance(other, DecodeRows) and np.array_equal(self.cols, other.cols)

    def __repr__(self) -> str:
        return f"DecodeRows({list(self)!r})"

    def to_bytes(self) -> bytes:
        return self.cols.astype("<i4").tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes) -> "DecodeRows":
        if len(blob) % 16:
            raise ProtocolError(f"decode rows: {len(blob)} bytes is not a whole number of rows")
        return cls(np.frombuffer(blob, dtype="<i4").astype(np.int64).reshape(4, -1))


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """Chunk ``tokens`` at positions ``start..``; ``sample`` on a prompt's last chunk;
    ``next_token``: the prompt token after the chunk (prompt-logprob target), -1 if none."""

    rank: int
    slot: int
    start: int
    tokens: tuple[int, ...]
    sample: bool
    output_index: int
    next_token: int


@dataclass(frozen=True, slots=True)
class StepCommand:
    """Everything every rank needs for one step, in apply order: releases, new sequences,
    sampling updates, block updates, then the rows (decode rows first, then prefill)."""

    step_id: int
    kind: int = KIND_STEP
    releases: tuple[Release, ...] = ()
    new_seqs: tuple[NewSeq, ...] = ()
    sampling_updates: tuple[SamplingUpdate, ...] = ()
    block_updates: tuple[BlockUpdate, ...] = ()
    decode: DecodeRows = field(default_factory=DecodeRows)
    prefill: tuple[PrefillRow, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.decode, DecodeRows):  # a tuple of DecodeRow is accepted too
            object.__setattr__(self, "decode", DecodeRows.from_rows(tuple(self.decode)))
        elif self.decode.cols.size and (self.decode.cols.min() < -(2**31)
                                        or self.decode.cols.max() >= 2**31):
            raise ProtocolError("decode rows: a value does not fit in int32")


# --------------------------------------------------------------------------- encode


def _samp(s: Sampling) -> list:
    return [s.temperature, s.top_p, s.top_k, s.min_p, s.seed, list(s.banned), s.logprobs]


def encode(cmd: StepCommand) -> bytes:
    """The frame for ``cmd``; ``ProtocolError`` if it would exceed ``MAX_FRAME_BYTES``."""
    body = [
        PROTOCOL_VERSION, cmd.step_id, cmd.kind,
        [[r.rank, r.slot] for r in cmd.releases],
        [[n.rank, n.slot, n.seq_len, n.prompt_len, n.prompt_logprobs, _samp(n.sampling)]
         for n in cmd.new_seqs],
        [[u.rank, u.slot, _samp(u.sampling)] for u in cmd.sampling_updates],
        [[b.rank, b.slot, b.first, list(b.blocks)] for b in cmd.block_updates],
        cmd.decode.to_bytes(),
        [[p.rank, p.slot, p.start, list(p.tokens), p.sample, p.output_index, p.next_token]
         for p in cmd.prefill],
    ]
    try:
        frame = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot encode: {exc}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    return frame


# --------------------------------------------------------------------------- decode


def _int(v: Any, what: str) -> int:
    if type(v) is not int:
        raise ProtocolError(f"{what}: expected int, got {type(v).__name__}")
    if not -(2**63) <= v < 2**64:
        raise ProtocolError(f"{what}: int out of range")
    return v


def _float(v: Any, what: str) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise ProtocolError(f"{what}: expected float, got {type(v).__name__}")


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(f"{what}: expected bool, got {type(v).__name__}")
    return v


def _list(v: Any, what: str, n: int | None = None) -> list:
    if type(v) is not list:
        raise ProtocolError(f"{what}: expected array, got {type(v).__name__}")
    if n is not None and len(v) != n:
        raise ProtocolError(f"{what}: expected {n} fields, got {len(v)}")
    return v


def _bin(v: Any, what: str) -> bytes:
    if type(v) is not bytes:
        raise ProtocolError(f"{what}: expected bin, got {type(v).__name__}")
    return v


def _ints(v: Any, what: str) -> tuple[int, ...]:
    return tuple(_int(x, what) for x in _list(v, what))


def _sampling(v: Any) -> Sampling:
    f = _list(v, "sampling", 7)
    return Sampling(_float(f[0], "temperature"), _float(f[1], "top_p"), _int(f[2], "top_k"),
                    _float(f[3], "min_p"), _int(f[4], "seed"), _ints(f[5], "banned"),
                    _int(f[6], "logprobs"))


def _rows(v: Any, what: str, n: int) -> list[list]:
    return [_list(r, what, n) for r in _list(v, what)]


def _decode_body(f: list) -> StepCommand:
    return StepCommand(
        step_id=_int(f[1], "step_id"),
        kind=_int(f[2], "kind"),
        releases=tuple(Release(_int(r[0], "rank"), _int(r[1], "slot"))
                       for r in _rows(f[3], "releases", 2)),
        new_seqs=tuple(NewSeq(_int(r[0], "rank"), _int(r[1], "slot"), _int(r[2], "seq_len"),
                              _int(r[3], "prompt_len"), _int(r[4], "prompt_logprobs"),
                              _sampling(r[5])) for r in _rows(f[4], "new_seqs", 6)),
        sampling_updates=tuple(SamplingUpdate(_int(r[0], "rank"), _int(r[1], "slot"),
                                              _sampling(r[2]))
                               for r in _rows(f[5], "sampling_updates", 3)),
        block_updates=tuple(BlockUpdate(_int(r[0], "rank"), _int(r[1], "slot"),
                                        _int(r[2], "first"), _ints(r[3], "blocks"))
                            for r in _rows(f[6], "block_updates", 4)),
        decode=DecodeRows.from_bytes(_bin(f[7], "decode")),
        prefill=tuple(PrefillRow(_int(r[0], "rank"), _int(r[1], "slot"), _int(r[2], "start"),
                                 _ints(r[3], "tokens"), _bool(r[4], "sample"),
                                 _int(r[5], "output_index"), _int(r[6], "next_token"))
                      for r in _rows(f[8], "prefill", 7)),
    )


def decode(frame: bytes) -> StepCommand:
    """The ``StepCommand`` in ``frame``; ``ProtocolError`` for anything malformed."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        # unpackb bounds every declared str/bin/array/map length by len(frame) itself, so a
        # short frame cannot make it allocate much (it has no max_buffer_size argument).
        body = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several types; all mean "malformed"
        raise ProtocolError(f"not a msgpack frame: {type(exc).__name__}: {exc}") from None
    f = _list(body, "frame", 9)
    if _int(f[0], "version") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {f[0]}, this rank speaks {PROTOCOL_VERSION}")
    try:
        return _decode_body(f)
    except ProtocolError:
        raise
    except Exception as exc:  # defensive: no other exception type may escape
        raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from None
