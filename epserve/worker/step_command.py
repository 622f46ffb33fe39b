"""The EP step command: one msgpack frame per forward pass, leader to every rank.

Owns the wire schema (``StepCommand`` and its row types), its encoder, and a strict decoder.
Invariants: nothing is pickled; a frame is the msgpack array ``[PROTOCOL_VERSION, step_id,
kind, <row tables>]`` and is read against exactly that layout (``worker.wire``); every row kind
travels as one bin of fixed-width little-endian records (ints are int64, seeds uint64, floats
float64, bools one byte of 0 or 1) and, where its rows carry ids (chunk tokens, block ids,
banned ids, logit-bias ids and their float64 biases as word pairs), one bin of int32 words; a frame above ``MAX_FRAME_BYTES`` is refused on both ends;
the decoder turns any malformed bytes into ``ProtocolError`` and nothing else, and costs at
most about 3x the frame's size in memory (rows are built when read). Semantic checks (known
slots, block ranges, sampling values) are not here: they need the ranks' state
(``worker.ep_mirror``); ``WireLimits`` only caps sizes no correct leader exceeds.

After a sequence's first appearance (``NewSeq``) only what changed travels: chunk tokens,
decode feeds (a token id, or ``FEED_DEVICE``: the token this rank sampled for the slot last
step), new block-table entries, sampling updates, releases; the decode rows that ran in the
last step and run again, fed what they sampled, travel as one flag (``repeat``, less the
indices ``dropped``; ``worker.decode_rows``). A row whose output is constrained
(structured output) carries its allowed tokens every step it samples (``MaskRow``: the packed
bitmask, ``ceil(vocab / 32)`` int32 words, bit ``t % 32`` of word ``t // 32`` for token ``t``).
A speculative verify row (``VerifyRow``) feeds a decode row's token and its drafted tokens in
one go; the next command rewinds the sequence to what was accepted (``Rewind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from epserve.models.sampling_rules import MAX_LOGPROBS
from epserve.models.traits import RowSampling
from epserve.worker.decode_rows import FEED_DEVICE, DecodeRow, DecodeRows  # noqa: F401
from epserve.worker.sampling_wire import (
    SAMPLING_FIELDS, SAMPLING_KINDS, check_bias_counts, row_sampling, sampling_fields,
    sampling_words,
)

# ProtocolError and Ints belong to the wire; ranks and the leader import them from here.
from epserve.worker.wire import (
    F64, I64, U64, Ints, ProtocolError, TableSpec, decode_table, encode_table, ids_spec,
    pack_frame, read_fields,
)

# 2: row tables of fixed-width records; 3: token-mask rows; 4: verify; 5: logit_bias;
# 6: MTP drafts in the result; 7: sampling penalties; 8: repeated decode rows
PROTOCOL_VERSION = 8
MAX_DRAFT_TOKENS = 16  # drafted tokens one verify row may carry
MAX_FRAME_BYTES = 64 * 2**20

KIND_STEP = 0
KIND_SHUTDOWN = 1
# a step whose decode rows' next step is likely and whose next KV blocks travel with it: the
# rank may queue that next forward early (``worker.lookahead``; one rank only)
KIND_DECODE_AHEAD = 2


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Sizes a correct leader never exceeds, known to every rank: ``world_size * max_slots``
    rows of any one kind (and decode plus prefill rows together), ``max_blocks_per_seq`` block
    ids per update, when given ``max_step_tokens`` prefill tokens per command and
    ``mask_words`` words per token mask (``ceil(vocab / 32)``), and ``max_logprobs``
    alternatives per entry of a rank's result (the engine's bound). A frame beyond them is a
    ``ProtocolError`` before any row is built."""

    world_size: int
    max_slots: int
    max_blocks_per_seq: int
    max_step_tokens: int | None = None
    mask_words: int | None = None
    max_logprobs: int = MAX_LOGPROBS

    @property
    def max_rows(self) -> int:
        return self.world_size * self.max_slots


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
    sampling: RowSampling


@dataclass(frozen=True, slots=True)
class SamplingUpdate:
    rank: int
    slot: int
    sampling: RowSampling


@dataclass(frozen=True, slots=True)
class BlockUpdate:
    """Block-table entries ``blocks`` placed from logical index ``first`` on."""

    rank: int
    slot: int
    first: int
    blocks: Sequence[int]


@dataclass(frozen=True, slots=True)
class Release:
    rank: int
    slot: int


@dataclass(frozen=True, slots=True)
class PrefillRow:
    """Chunk ``tokens`` at positions ``start..``; ``sample`` on a prompt's last chunk;
    ``next_token``: the prompt token after the chunk (prompt-logprob target), -1 if none."""

    rank: int
    slot: int
    start: int
    tokens: Sequence[int]  # a tuple when built by the leader, ``Ints`` when decoded
    sample: bool
    output_index: int
    next_token: int


@dataclass(frozen=True, slots=True)
class VerifyRow:
    """A decode row with ``drafts``: ``feed`` (a token id or ``FEED_DEVICE``) at the sequence's
    KV length L and drafted token i at L + 1 + i; every position samples (draw ``output_index
    + i``), so the rank returns the target's token at each of the ``len(drafts) + 1``
    positions and KV is written for all of them. What was accepted comes back as a
    ``Rewind`` in a later command."""

    rank: int
    slot: int
    feed: int
    output_index: int
    drafts: Sequence[int]


@dataclass(frozen=True, slots=True)
class Rewind:
    """The sequence in ``slot`` keeps KV for its first ``seq_len`` tokens and its first
    ``nblocks`` block-table entries (after a verify: the accepted prefix)."""

    rank: int
    slot: int
    seq_len: int
    nblocks: int


@dataclass(frozen=True, slots=True, eq=False)
class MaskRow:
    """The tokens ``slot``'s row may sample this step: ``words`` [ceil(V / 32)] int32 (a
    numpy array; the leader's may be the head's own buffer, read before its next fill)."""

    rank: int
    slot: int
    words: "np.ndarray"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MaskRow) and (self.rank, self.slot) == (other.rank, other.slot)
                and np.array_equal(self.words, other.words))


@dataclass(frozen=True, slots=True)
class StepCommand:
    """Everything every rank needs for one step, in apply order: releases, new sequences,
    rewinds, sampling updates, block updates, then the rows (decode rows, verify rows, then
    prefill), then the token masks of the constrained sampled rows. Row fields are tuples when
    built by the leader, ``wire.Table`` when decoded (equal either way). ``repeat``: the decode
    rows of the last command every rank applied run again first (``worker.decode_rows`` says
    how), less those at the indices ``dropped`` (ascending); ``decode`` follows them."""

    step_id: int
    kind: int = KIND_STEP
    releases: Sequence[Release] = ()
    new_seqs: Sequence[NewSeq] = ()
    rewinds: Sequence[Rewind] = ()
    sampling_updates: Sequence[SamplingUpdate] = ()
    block_updates: Sequence[BlockUpdate] = ()
    decode: DecodeRows = field(default_factory=DecodeRows)
    prefill: Sequence[PrefillRow] = ()
    masks: Sequence[MaskRow] = ()
    verify: Sequence[VerifyRow] = ()
    repeat: bool = False
    dropped: Sequence[int] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.decode, DecodeRows):  # a tuple of DecodeRow is accepted too
            object.__setattr__(self, "decode", DecodeRows.from_rows(tuple(self.decode)))


# --------------------------------------------------------------------------- row tables

RELEASES = TableSpec("releases", np.dtype([("rank", I64), ("slot", I64)]),
                     lambda r: (r.rank, r.slot), lambda v, _: Release(*v), "ii")
NEW_SEQS = ids_spec(
    "new_seqs", [("rank", I64), ("slot", I64), ("seq_len", I64), ("prompt_len", I64),
                 ("prompt_logprobs", I64)] + SAMPLING_FIELDS, "iiiii" + SAMPLING_KINDS,
    lambda n: (n.rank, n.slot, n.seq_len, n.prompt_len, n.prompt_logprobs,
               *sampling_fields(n.sampling)),
    lambda n: sampling_words(n.sampling), lambda v, b: NewSeq(*v[:5], row_sampling(v[5:], b)))
SAMPLING_UPDATES = ids_spec(
    "sampling_updates", [("rank", I64), ("slot", I64)] + SAMPLING_FIELDS, "ii" + SAMPLING_KINDS,
    lambda u: (u.rank, u.slot, *sampling_fields(u.sampling)),
    lambda u: sampling_words(u.sampling),
    lambda v, b: SamplingUpdate(v[0], v[1], row_sampling(v[2:], b)))
BLOCK_UPDATES = ids_spec(
    "block_updates", [("rank", I64), ("slot", I64), ("first", I64)], "iii",
    lambda b: (b.rank, b.slot, b.first), lambda b: b.blocks,
    lambda v, ids: BlockUpdate(v[0], v[1], v[2], ids))
PREFILL = ids_spec(
    "prefill", [("rank", I64), ("slot", I64), ("start", I64), ("sample", "u1"),
                ("output_index", I64), ("next_token", I64)], "iii?ii",
    lambda p: (p.rank, p.slot, p.start, p.sample, p.output_index, p.next_token),
    lambda p: p.tokens,
    lambda v, ids: PrefillRow(v[0], v[1], v[2], ids, bool(v[3]), v[4], v[5]))

REWINDS = TableSpec("rewinds", np.dtype([("rank", I64), ("slot", I64), ("seq_len", I64),
                                         ("nblocks", I64)]),
                    lambda r: (r.rank, r.slot, r.seq_len, r.nblocks), lambda v, _: Rewind(*v),
                    "iiii")
VERIFY = ids_spec(
    "verify", [("rank", I64), ("slot", I64), ("feed", I64), ("output_index", I64)], "iiii",
    lambda v: (v.rank, v.slot, v.feed, v.output_index), lambda v: v.drafts,
    lambda v, ids: VerifyRow(v[0], v[1], v[2], v[3], ids))


def _mask_words(rows: list) -> np.ndarray:
    """Every mask row's words, concatenated (numpy arrays, no Python ints)."""
    try:
        arrays = [np.asarray(w.array if isinstance(w, Ints) else w) for w in rows]
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"token_masks: {exc}") from None
    if any(a.ndim != 1 or a.dtype.kind not in "iu" or a.dtype.itemsize > 4 for a in arrays):
        raise ProtocolError("token_masks: words must be 1-D int32 arrays")
    return np.concatenate(arrays).astype("<i4", copy=False)


TOKEN_MASKS = TableSpec(
    "token_masks", np.dtype([("rank", I64), ("slot", I64), ("n", I64)]),
    lambda m: (m.rank, m.slot), lambda v, words: MaskRow(v[0], v[1], words), "ii",
    np.dtype("<i4"), lambda m: m.words, _mask_words)

# version, step_id, kind, releases, new_seqs (+ banned), sampling_updates (+ banned),
# block_updates (+ block ids), decode rows, prefill (+ tokens), token masks (+ words),
# rewinds, verify rows (+ drafts), repeat, dropped
_LAYOUT = "iii" + "b" * 15 + "ib"


# --------------------------------------------------------------------------- encode / decode


def encode(cmd: StepCommand) -> bytes:
    """The frame for ``cmd``; ``ProtocolError`` if a field has the wrong type or does not fit
    its record, or the frame would exceed ``MAX_FRAME_BYTES``."""
    for name in ("step_id", "kind", "repeat"):
        if type(getattr(cmd, name)) is not (bool if name == "repeat" else int):
            raise ProtocolError(f"{name}: expected int, got {type(getattr(cmd, name)).__name__}")
    body: list = [PROTOCOL_VERSION, cmd.step_id, cmd.kind]
    for spec, rows in ((RELEASES, cmd.releases), (NEW_SEQS, cmd.new_seqs),
                       (SAMPLING_UPDATES, cmd.sampling_updates),
                       (BLOCK_UPDATES, cmd.block_updates)):
        body.extend(b for b in encode_table(spec, rows) if b is not None)
    body.append(cmd.decode.to_bytes())
    body.extend(encode_table(PREFILL, cmd.prefill))
    body.extend(encode_table(TOKEN_MASKS, cmd.masks))
    body.extend(b for b in encode_table(REWINDS, cmd.rewinds) if b is not None)
    body.extend(encode_table(VERIFY, cmd.verify))
    body.append(int(cmd.repeat))
    body.append(_int32_words(cmd.dropped, "dropped"))
    return pack_frame(body, MAX_FRAME_BYTES, "frame")


def _int32_words(values: Sequence[int], what: str) -> bytes:
    try:
        return np.asarray(values, dtype="<i4").reshape(-1).tobytes()
    except (OverflowError, ValueError, TypeError) as exc:
        raise ProtocolError(f"{what}: {exc}") from None


def decode(frame: bytes, limits: WireLimits | None = None) -> StepCommand:
    """The ``StepCommand`` in ``frame``; ``ProtocolError`` for anything malformed or, with
    ``limits``, beyond them. Rows stay records until read (``wire.Table``)."""
    f = read_fields(frame, _LAYOUT, PROTOCOL_VERSION, MAX_FRAME_BYTES, "frame")
    rows = None if limits is None else limits.max_rows
    blocks = None if limits is None else limits.max_blocks_per_seq
    try:
        cmd = StepCommand(
            step_id=f[1], kind=f[2],
            releases=decode_table(RELEASES, f[3], None, rows),
            new_seqs=check_bias_counts(decode_table(NEW_SEQS, f[4], f[5], rows)),
            sampling_updates=check_bias_counts(
                decode_table(SAMPLING_UPDATES, f[6], f[7], rows)),
            block_updates=decode_table(BLOCK_UPDATES, f[8], f[9], rows, blocks),
            decode=DecodeRows.from_bytes(f[10], rows),
            prefill=decode_table(PREFILL, f[11], f[12], rows),
            masks=decode_table(TOKEN_MASKS, f[13], f[14], rows,
                               None if limits is None else limits.mask_words),
            rewinds=decode_table(REWINDS, f[15], None, rows),
            verify=decode_table(VERIFY, f[16], f[17], rows, MAX_DRAFT_TOKENS),
            repeat=_flag(f[18], "repeat"), dropped=_words(f[19], rows, "dropped"))
    except ProtocolError:
        raise
    except Exception as exc:  # defensive: no other exception type may escape
        raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from None
    if limits is not None:
        n = len(cmd.decode) + len(cmd.prefill) + len(cmd.verify)
        if n > rows:
            raise ProtocolError(f"{n} rows exceed {rows}")
        tokens = len(cmd.prefill.flat)
        if limits.max_step_tokens is not None and tokens > limits.max_step_tokens:
            raise ProtocolError(f"{tokens} prefill tokens exceed {limits.max_step_tokens}")
    return cmd


def _flag(v: int, what: str) -> bool:
    if v not in (0, 1):
        raise ProtocolError(f"{what}: expected 0 or 1, got {v}")
    return bool(v)


def _words(blob: bytes, most: int | None, what: str) -> Ints:
    """A bin of int32 words (a view of the frame's bytes)."""
    if len(blob) % 4:
        raise ProtocolError(f"{what}: {len(blob)} bytes is not a whole number of int32 words")
    if most is not None and len(blob) // 4 > most:
        raise ProtocolError(f"{what}: {len(blob) // 4} entries exceed {most}")
    return Ints(np.frombuffer(blob, dtype="<i4"))
