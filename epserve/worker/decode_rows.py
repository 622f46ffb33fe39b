"""The decode rows of a step command: one token per sequence, as four int32 columns.

A decode row names its sequence (rank, slot), the token it feeds (a token id, or ``FEED_DEVICE``:
the token its rank sampled for the slot in the step before) and its output index (the draw a
seeded row uses). A command carries them either explicitly (``DecodeRows``) or, for the rows
that ran in the last applied command and run again, as a repeat (``StepCommand.repeat``): each
such row feeds the token it sampled, at its output index plus one, in the same order, less the
rows the command drops (``worker.ep_mirror`` resolves a repeat, alike on every rank). So a
steady decode batch costs a step no per-row bytes or checks beyond its positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from epserve.worker.wire import ProtocolError

FEED_DEVICE = -1  # a decode row's token is the one its rank sampled for the slot last step


@dataclass(frozen=True, slots=True)
class DecodeRow:
    """One token for ``slot``: ``feed`` is a token id or ``FEED_DEVICE``."""

    rank: int
    slot: int
    feed: int
    output_index: int


_NO_COLS = np.zeros((4, 0), dtype=np.int32)


class DecodeRows:
    """The decode rows as four int32 columns (rank, slot, feed, output_index): 256 rows are one
    4 KiB blob on the wire and numpy arrays on arrival, not 256 objects to build and check."""

    __slots__ = ("cols",)

    def __init__(self, cols: "np.ndarray | None" = None, *, fits: bool = False):
        """``fits``: the caller knows every value fits in int32 (decoded, or joined checked)."""
        c = _NO_COLS if cols is None else np.asarray(cols)
        if c.ndim != 2 or c.shape[0] != 4:
            raise ProtocolError(f"decode rows: expected 4 columns, got shape {c.shape}")
        if c.dtype != np.int32:
            if c.dtype.kind not in "iu":
                raise ProtocolError(f"decode rows: expected integers, got {c.dtype}")
            if not fits and c.size and (c.min() < -(2**31) or c.max() >= 2**31):
                raise ProtocolError("decode rows: a value does not fit in int32")
            c = c.astype(np.int32)
        self.cols = c

    @classmethod
    def of(cls, rank: Sequence[int], slot: Sequence[int], feed: Sequence[int],
           output_index: Sequence[int]) -> "DecodeRows":
        try:  # int32 at once: numpy refuses a Python int that does not fit
            cols = np.array([rank, slot, feed, output_index], dtype=np.int32).reshape(4, -1)
        except (OverflowError, ValueError, TypeError) as exc:
            raise ProtocolError(f"decode rows: {exc}") from None
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
        return DecodeRows(np.concatenate([self.cols, extra.cols], axis=1), fits=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, tuple):
            other = DecodeRows.from_rows(other)
        return isinstance(other, DecodeRows) and np.array_equal(self.cols, other.cols)

    def __repr__(self) -> str:
        return f"DecodeRows({list(self)!r})"

    def to_bytes(self) -> bytes:
        return self.cols.astype("<i4", copy=False).tobytes()

    @classmethod
    def from_bytes(cls, blob: bytes, max_rows: int | None = None) -> "DecodeRows":
        if len(blob) % 16:
            raise ProtocolError(f"decode rows: {len(blob)} bytes is not a whole number of rows")
        if max_rows is not None and len(blob) // 16 > max_rows:
            raise ProtocolError(f"decode rows: {len(blob) // 16} rows exceed {max_rows}")
        return cls(np.frombuffer(blob, dtype="<i4").astype(np.int32, copy=False).reshape(4, -1),
                   fits=True)
