"""Bounded msgpack framing shared by the EP codecs: a fixed top-level layout, id runs, row tables.

Owns the decoding primitives of ``worker.step_command`` (step commands) and ``worker.ep_results``
(rank results). Invariants: a frame is read against its layout, never unpacked as a generic
msgpack tree (the unpacker may build no array, map, str or ext with an element, so no container
can grow where an int or bin belongs); every variable-size part travels as one ``bin`` of
fixed-width little-endian records that numpy views in place; row objects are built from those
records only when a consumer reads them, ``_CHUNK`` rows at a time. So decoding a frame of
``n`` bytes allocates at most about ``3n`` (the unpacker's copy of the frame, the bins it
copies out, the decode rows widened to int64) plus a fixed few KiB, whatever the bytes are;
anything malformed is a ``ProtocolError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, Iterator, Sequence

import msgpack
import numpy as np

_CHUNK = 1024  # rows built per numpy call while iterating: few calls, bounded transient memory
I64, U64, F64 = "<i8", "<u8", "<f8"


class ProtocolError(ValueError):
    """A frame that is not well formed (the channel may be broken)."""


def read_fields(frame: Any, layout: str, version: int, max_bytes: int, what: str) -> list:
    """The fields of ``frame``, a msgpack array ``[version, ...]`` of exactly ``len(layout)``
    items: ``i`` an int, ``b`` a bin. ``ProtocolError`` for anything else, without building
    more than one empty container (the unpacker's limits refuse any longer one)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"{what} must be bytes, got {type(frame).__name__}")
    size = memoryview(frame).nbytes
    if size > max_bytes:
        raise ProtocolError(f"{what} of {size} bytes exceeds {max_bytes}")
    unpacker = msgpack.Unpacker(max_buffer_size=max(size, 1), max_bin_len=size, max_str_len=0,
                                max_array_len=0, max_map_len=0, max_ext_len=0)
    try:
        unpacker.feed(frame)
        count = unpacker.read_array_header()  # the one array: its length is checked, not built
        fields = [unpacker.unpack() for _ in range(min(count, 1))]
        if not fields or type(fields[0]) is not int:
            raise ProtocolError(f"{what}: no protocol version")
        if fields[0] != version:
            raise ProtocolError(f"protocol version {fields[0]}, this side speaks {version}")
        if count != len(layout):
            raise ProtocolError(f"{what}: expected {len(layout)} fields, got {count}")
        for kind in layout[1:]:
            v = unpacker.unpack()
            if type(v) is not (int if kind == "i" else bytes):
                raise ProtocolError(f"{what}: field {len(fields)} must be "
                                    f"{'an int' if kind == 'i' else 'a bin'}, "
                                    f"got {type(v).__name__}")
            fields.append(v)
        if unpacker.tell() != size:
            raise ProtocolError(f"{what}: {size - unpacker.tell()} trailing bytes")
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several types; all mean "malformed"
        raise ProtocolError(f"{what}: not a msgpack frame: {type(exc).__name__}: {exc}") from None
    return fields


def pack_frame(body: list, max_bytes: int, what: str) -> bytes:
    """``body`` as one msgpack frame; ``ProtocolError`` if it cannot be or exceeds
    ``max_bytes`` (refused at the sender as at every receiver)."""
    try:
        frame = msgpack.packb(body, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot encode {what}: {exc}") from None
    if len(frame) > max_bytes:
        raise ProtocolError(f"{what} of {len(frame)} bytes exceeds {max_bytes}")
    return frame


def int32s(values: Sequence[int], what: str) -> np.ndarray:
    """``values`` as a little-endian int32 array; ``ProtocolError`` unless they are ints that
    fit (a float, str or anything numpy would coerce silently is refused)."""
    if isinstance(values, Ints):
        return values.array
    a = np.array(values if isinstance(values, (list, tuple)) else list(values))
    if a.size == 0:
        return np.zeros(0, "<i4")
    if a.ndim != 1 or a.dtype.kind not in "iu":  # floats, strs, bools, ints beyond 64 bits
        raise ProtocolError(f"{what}: expected int32 ids, got {a.dtype} values")
    if a.min() < -(2**31) or a.max() >= 2**31:
        raise ProtocolError(f"{what}: a value does not fit in int32")
    return a.astype("<i4")


def _chunks(a: np.ndarray) -> Iterator:
    for lo in range(0, a.shape[0], _CHUNK):
        yield from a[lo:lo + _CHUNK].tolist()


class Ints(Sequence[int]):
    """An immutable run of int32 ids (chunk tokens, block ids, banned ids): 4 bytes an id, a
    view of the frame's bytes when decoded. Reads as Python ints; equal to a tuple or list of
    the same ints (and hashes like that tuple)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array  # 1-D int32, not copied

    def __len__(self) -> int:
        return self.array.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Ints(self.array[i])
        return int(self.array[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist()) if len(self) <= _CHUNK else _chunks(self.array)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Ints):
            return np.array_equal(self.array, other.array)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and self.array.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.array.tolist()))

    def __repr__(self) -> str:
        return f"Ints({self.array.tolist()!r})"


def _ints_flat(extras: list) -> np.ndarray:
    if all(type(e) is Ints for e in extras):
        return np.concatenate([e.array for e in extras]) if extras else np.zeros(0, "<i4")
    return int32s(list(chain.from_iterable(extras)), "ids")


@dataclass(frozen=True, eq=False)
class TableSpec:
    """How rows of one kind travel. ``dtype``: the row's fixed-width record; with ``flat`` set,
    its last field ``n`` counts the row's entries in the table's ``flat`` part (``extra(row)``
    gives them, ``pack_flat`` packs every row's at once). ``record(row)``: the record's values
    but ``n``; ``kinds``: their Python types for the encoder's check (``i`` int, ``f`` float or
    int, ``?`` bool), None to let numpy convert; ``make(values, flat_slice)``: the row object."""

    name: str
    dtype: np.dtype
    record: Callable[[Any], tuple]
    make: Callable[[tuple, Any], Any]
    kinds: str | None = None
    flat: np.dtype | None = None
    extra: Callable[[Any], Sequence] | None = None
    pack_flat: Callable[[list], np.ndarray] = _ints_flat
    bools: tuple[str, ...] = ()


def ids_spec(name: str, fields: list, kinds: str | None, record: Callable[[Any], tuple],
             extra: Callable[[Any], Sequence[int]],
             make: Callable[[tuple, Ints], Any]) -> TableSpec:
    """A spec whose rows each carry one run of int32 ids (read back as ``Ints``); ``u1``
    fields are bools on the wire (0 or 1)."""
    return TableSpec(name, np.dtype(fields + [("n", I64)]), record,
                     lambda v, ids: make(v, Ints(ids)), kinds, np.dtype("<i4"), extra,
                     bools=tuple(f for f, t in fields if t == "u1"))


class Table(Sequence):
    """Decoded rows of one kind, kept as their records (``recs``: [n] structured, a view of the
    frame; ``flat`` and ``offsets`` [n + 1] int64 for the rows' entries) and built into row
    objects only when read. Equal to a tuple or list of equal rows; ``+`` gives a tuple."""

    __slots__ = ("spec", "recs", "flat", "offsets")

    def __init__(self, spec: TableSpec, recs: np.ndarray, flat: np.ndarray | None,
                 offsets: np.ndarray | None):
        self.spec, self.recs, self.flat, self.offsets = spec, recs, flat, offsets

    def __len__(self) -> int:
        return self.recs.shape[0]

    def _rows(self, lo: int, hi: int) -> list:
        make, values = self.spec.make, self.recs[lo:hi].tolist()
        if self.flat is None:
            return [make(v, None) for v in values]
        flat, offs = self.flat, self.offsets[lo:hi + 1].tolist()
        return [make(v, flat[offs[k]:offs[k + 1]]) for k, v in enumerate(values)]

    def __iter__(self) -> Iterator:
        for lo in range(0, len(self), _CHUNK):
            yield from self._rows(lo, lo + _CHUNK)

    def __getitem__(self, i):
        if isinstance(i, slice):
            r = range(len(self))[i]
            if r.step == 1:
                return tuple(self._rows(r.start, max(r.start, r.stop)))
            return tuple(self[j] for j in r)
        j = range(len(self))[i]  # IndexError as a tuple would raise it
        return self._rows(j, j + 1)[0]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (Table, tuple, list)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Sequence) -> tuple:
        return tuple(self) + tuple(other)

    def __radd__(self, other: Sequence) -> tuple:
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"Table[{self.spec.name}]({list(self)!r})"


_NO_OFFSETS = np.zeros(1, np.int64)
_NO_OFFSETS.flags.writeable = False
_KIND_NAMES = {"i": "int", "f": "float", "?": "bool"}


def _check_kinds(values: tuple, kinds: str, what: str) -> None:
    for v, k in zip(values, kinds):
        t = type(v)
        ok = (k != "?") if t is int else (k == "?") if t is bool else (
            k == "f" and isinstance(v, float))
        if not ok:
            raise ProtocolError(f"{what}: expected {_KIND_NAMES[k]}, got {t.__name__}")


def encode_table(spec: TableSpec, rows: Sequence) -> tuple[bytes, bytes | None]:
    """The records bin and (for a spec with ``flat``) the entries bin of ``rows``."""
    if not rows:  # most steps carry no rows of most kinds
        return b"", None if spec.flat is None else b""
    if isinstance(rows, Table) and rows.spec is spec:  # a decoded table travels as it came
        return rows.recs.tobytes(), None if rows.flat is None else rows.flat.tobytes()
    values, extras = [], []
    try:
        for row in rows:
            v = spec.record(row)
            if spec.kinds is not None:
                _check_kinds(v, spec.kinds, spec.name)
            if spec.flat is not None:
                e = spec.extra(row)
                extras.append(e)
                v = (*v, len(e))
            values.append(v)
        recs = np.array(values, dtype=spec.dtype)
        flat = None if spec.flat is None else spec.pack_flat(extras).astype(spec.flat)
    except ProtocolError:
        raise
    except (AttributeError, OverflowError, TypeError, ValueError) as exc:
        raise ProtocolError(f"cannot encode {spec.name}: {type(exc).__name__}: {exc}") from None
    return recs.tobytes(), None if flat is None else flat.tobytes()


def decode_table(spec: TableSpec, recs: bytes, flat: bytes | None, max_rows: int | None = None,
                 max_per_row: int | None = None) -> Table:
    """The ``Table`` of two bins; ``ProtocolError`` if they are not whole records, the entry
    counts do not add up to the entries, or a row count or per-row count exceeds its cap."""
    size = spec.dtype.itemsize
    if len(recs) % size:
        raise ProtocolError(f"{spec.name}: {len(recs)} bytes is not a whole number of "
                            f"{size}-byte records")
    if max_rows is not None and len(recs) // size > max_rows:
        raise ProtocolError(f"{spec.name}: {len(recs) // size} rows exceed {max_rows}")
    r = np.frombuffer(recs, spec.dtype)
    if not len(r):  # most steps carry no rows of most kinds
        if flat:
            raise ProtocolError(f"{spec.name}: entries without rows")
        return Table(spec, r, None if flat is None else np.zeros(0, spec.flat), _NO_OFFSETS)
    for name in spec.bools:
        if r[name].max() > 1:
            raise ProtocolError(f"{spec.name}: {name} is not a bool")
    if spec.flat is None:
        return Table(spec, r, None, None)
    if len(flat) % spec.flat.itemsize:
        raise ProtocolError(f"{spec.name}: {len(flat)} bytes is not a whole number of entries")
    f = np.frombuffer(flat, spec.flat)
    n = r["n"]
    cap = len(f) if max_per_row is None else min(len(f), max_per_row)
    if n.min() < 0 or n.max() > cap:
        raise ProtocolError(f"{spec.name}: an entry count outside [0, {cap}]")
    offsets = np.zeros(len(r) + 1, np.int64)
    np.cumsum(n, out=offsets[1:])  # cannot overflow: each count is at most len(f) < 2**26
    if offsets[-1] != len(f):
        raise ProtocolError(f"{spec.name}: rows count {offsets[-1]} entries, the frame holds "
                            f"{len(f)}")
    return Table(spec, r, f, offsets)
