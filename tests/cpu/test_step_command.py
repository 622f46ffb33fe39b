"""The StepCommand codec: every command shape round-trips; any malformed frame is a ProtocolError.

The fuzz tests count the frames they decode and assert what they promise (2,000 random byte
strings, 7,200 mutated valid frames, 2,000 valid msgpack values of the wrong shape: 11,200),
each decode bounded in time. Memory bounds of hostile frames: ``test_step_command_bounds``.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import fields, is_dataclass

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from epserve.models.traits import RowSampling
from epserve.worker import step_command as P
from epserve.worker.step_command import (BlockUpdate, DecodeRow, DecodeRows, Ints, MaskRow, NewSeq,
                                     PrefillRow, ProtocolError, Release, SamplingUpdate,
                                     StepCommand)
from epserve.worker.wire import Table

FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
I64_MIN, I64_MAX, U64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

# --------------------------------------------------------------------------- strategies

# step_id and kind are msgpack ints; record fields int64 (seeds uint64); ids and decode rows int32
wire_ints = st.one_of(st.integers(-3, 300), st.integers(I64_MIN, U64_MAX),
                      st.sampled_from([I64_MIN, U64_MAX, 2**63, 2**32, -(2**31), P.FEED_DEVICE]))
i64s = st.one_of(st.integers(-3, 300), st.integers(I64_MIN, I64_MAX),
                 st.sampled_from([I64_MIN, I64_MAX, 2**32, -(2**31), P.FEED_DEVICE]))
seeds = st.one_of(st.integers(0, 300), st.integers(0, U64_MAX), st.sampled_from([2**63, U64_MAX]))
row_ints = st.one_of(st.integers(-3, 300), st.integers(-(2**31), 2**31 - 1),
                     st.sampled_from([-(2**31), 2**31 - 1, 2**16, P.FEED_DEVICE]))
ids = st.lists(row_ints, max_size=6).map(tuple)
wire_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from([math.inf, -math.inf, math.nan, -0.0, 5e-324]))
small = dict(max_size=4)

samplings = st.builds(RowSampling, wire_floats, wire_floats, i64s, wire_floats, seeds,
                      st.lists(row_ints, **small).map(tuple),
                      st.one_of(st.none(), i64s.filter(lambda v: v != -1)),  # -1 is None
                      presence_penalty=wire_floats, frequency_penalty=wire_floats,
                      repetition_penalty=wire_floats)
step_commands = st.builds(
    StepCommand,
    step_id=wire_ints, kind=wire_ints,
    releases=st.lists(st.builds(Release, i64s, i64s), **small).map(tuple),
    new_seqs=st.lists(st.builds(NewSeq, i64s, i64s, i64s, i64s, i64s, samplings),
                      **small).map(tuple),
    sampling_updates=st.lists(st.builds(SamplingUpdate, i64s, i64s, samplings),
                              **small).map(tuple),
    block_updates=st.lists(st.builds(BlockUpdate, i64s, i64s, i64s, ids), **small).map(tuple),
    decode=st.lists(st.builds(DecodeRow, row_ints, row_ints, row_ints, row_ints),
                    max_size=6).map(tuple),
    prefill=st.lists(st.builds(PrefillRow, i64s, i64s, i64s, ids, st.booleans(), i64s, i64s),
                     **small).map(tuple),
    masks=st.lists(st.builds(MaskRow, i64s, i64s, ids.map(lambda t: np.array(t, np.int32))),
                   **small).map(tuple),
)

# Any msgpack value: what a confused or corrupted sender could put on the wire.
leaves = st.one_of(st.none(), st.booleans(), wire_ints, wire_floats, st.text(max_size=8),
                   st.binary(max_size=8),
                   st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8)))
garbage = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=10),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-5, 5), st.binary(max_size=3)),
                        inner, max_size=4)),
    max_leaves=20)


def _random_command(rng: random.Random) -> StepCommand:
    """A valid-on-the-wire command with 0-3 of every row kind (cheap seeds for the fuzzers)."""
    def i():
        return rng.choice([0, 1, 7, -1, 300, 2**40, I64_MAX, I64_MIN])

    def i32():  # ids and decode rows travel as int32
        return rng.choice([0, 1, 7, -1, 300, 2**20, 2**31 - 1, -(2**31)])

    def many(make, k=3):
        return tuple(make() for _ in range(rng.randrange(k + 1)))

    def samp():
        lp = i()
        return RowSampling(rng.random(), 1.0, i(), math.inf, rng.choice([0, 5, U64_MAX]),
                           many(i32), None if lp == -1 else lp)

    return StepCommand(
        step_id=rng.choice([0, 1, U64_MAX, I64_MIN]), kind=i(),
        releases=many(lambda: Release(i(), i())),
        new_seqs=many(lambda: NewSeq(i(), i(), i(), i(), i(), samp())),
        sampling_updates=many(lambda: SamplingUpdate(i(), i(), samp())),
        block_updates=many(lambda: BlockUpdate(i(), i(), i(), many(i32, 5))),
        decode=many(lambda: DecodeRow(i32(), i32(), i32(), i32()), 6),
        prefill=many(lambda: PrefillRow(i(), i(), i(), many(i32, 5), rng.random() < 0.5, i(),
                                        i())),
        masks=many(lambda: MaskRow(i(), i(), np.array(many(i32, 5), np.int32))),
        rewinds=many(lambda: P.Rewind(i(), i(), i(), i())),
        verify=many(lambda: P.VerifyRow(i(), i(), i(), i(), many(i32, 5))))


SEED_COMMANDS = [_random_command(random.Random(n)) for n in range(64)]
seed_commands = st.sampled_from(SEED_COMMANDS)


def _same(a, b) -> bool:
    """Structural equality where nan equals nan (nan != nan under ==) and a decoded ``Table``
    or ``Ints`` matches the tuple it was built from; every scalar keeps its exact type."""
    if isinstance(a, MaskRow):  # its words are an array: compared as one
        return a == b
    if is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in fields(a))
    if isinstance(a, DecodeRows):
        return a == b
    if isinstance(a, (tuple, Table, Ints)):
        return isinstance(b, (tuple, Table, Ints)) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def _decode_bounded(frame) -> StepCommand | None:
    """decode(frame): a StepCommand or None on ProtocolError; any other exception escapes."""
    t0 = time.perf_counter()
    try:
        out = P.decode(frame)
        assert isinstance(out, StepCommand)
    except ProtocolError:
        out = None
    assert time.perf_counter() - t0 < 1.0, f"decode of {len(frame)} bytes took too long"
    if out is not None:  # a frame that decodes has every row buildable, as consumers read them
        for rows in (out.releases, out.new_seqs, out.sampling_updates, out.block_updates,
                     out.decode, out.prefill, out.masks):
            assert all(is_dataclass(r) for r in rows)
        assert all(type(t) is int for p in out.prefill for t in p.tokens)
    return out


# --------------------------------------------------------------------------- round trip


@settings(FAST, max_examples=400)
@given(step_commands)
def test_every_command_shape_round_trips(cmd):
    assert _same(P.decode(P.encode(cmd)), cmd)


def test_seed_commands_round_trip():
    assert all(_same(P.decode(P.encode(c)), c) for c in SEED_COMMANDS)


def test_round_trip_examples():
    s = RowSampling(math.nan, math.inf, -1, -math.inf, U64_MAX, (), None)
    empty = StepCommand(step_id=0)
    full = StepCommand(
        step_id=I64_MIN, kind=P.KIND_SHUTDOWN, releases=(Release(0, 1),),
        new_seqs=(NewSeq(1, 2, 0, 7, -1, s),), sampling_updates=(SamplingUpdate(1, 2, s),),
        block_updates=(BlockUpdate(1, 2, 0, tuple(range(100))),),
        decode=(DecodeRow(0, 3, P.FEED_DEVICE, 0), DecodeRow(1, 2, -7, 1)),
        prefill=(PrefillRow(1, 2, 5, (), True, 2, -1),
                 PrefillRow(0, 0, 0, (2**31 - 1, -(2**31)), False, 3, 9)))
    for cmd in (empty, full):
        out = P.decode(P.encode(cmd))
        assert _same(out, cmd)
        assert out.decode == cmd.decode
        assert all(type(p.sample) is bool for p in out.prefill)
    assert math.isnan(P.decode(P.encode(full)).new_seqs[0].sampling.temperature)


def test_decoded_rows_serve_their_consumers():
    """What ep_mirror, rank_executor, step_model and cluster.faults do with a command's rows works the
    same on a decoded command as on the tuples the leader built."""
    s = RowSampling(0.5, 1.0, 0, 0.0, 3, (7, 8), None)
    built = StepCommand(step_id=3, new_seqs=(NewSeq(0, 1, 0, 4, 2, s),),
                        block_updates=(BlockUpdate(0, 1, 0, (5, 6)),),
                        prefill=(PrefillRow(0, 1, 0, (10, 11, 12), True, 0, 13),))
    cmd = P.decode(P.encode(built))
    assert cmd == built and built == cmd
    p, b, n = cmd.prefill[0], cmd.block_updates[0], cmd.new_seqs[-1]
    assert list(p.tokens[1:]) + [p.next_token] == [11, 12, 13]  # RankExecutor._prompt_logprobs
    assert len(p.tokens) == 3 and p.tokens[-1] == 12 and list(reversed(p.tokens)) == [12, 11, 10]
    assert all(type(t) is int for t in [*p.tokens, *b.blocks, *n.sampling.banned_token_ids])
    assert p.tokens == (10, 11, 12) and (10, 11, 12) == p.tokens and p.tokens != (10, 11)
    assert hash(p.tokens) == hash((10, 11, 12)) and hash(p) == hash(built.prefill[0])
    grown = cmd.block_updates + (BlockUpdate(0, 1, 2, (9,)),)  # cluster.faults appends rows
    assert grown == built.block_updates + (BlockUpdate(0, 1, 2, (9,)),)
    bad = dataclasses.replace(n.sampling, temperature=-1.0)  # ... and replaces fields
    again = P.decode(P.encode(dataclasses.replace(cmd, new_seqs=(dataclasses.replace(
        n, sampling=bad),), block_updates=grown)))
    assert again.new_seqs[0].sampling.temperature == -1.0 and len(again.block_updates) == 2
    assert P.decode(P.encode(cmd)) == cmd  # a decoded command re-encodes as it came
    assert cmd.releases == () and not cmd.releases and list(cmd.decode) == []
    with pytest.raises(IndexError):
        cmd.prefill[1]


def test_encoder_refuses_values_a_record_cannot_hold():
    """Strict types on the way out too: what the old decoder refused, the encoder refuses."""
    ok_s = RowSampling(1.0, 1.0, 0, 0.0, 0, (), None)
    bad = [
        StepCommand(step_id=True), StepCommand(step_id=1.0), StepCommand(step_id=1, kind=None),
        StepCommand(1, releases=(Release(True, 0),)), StepCommand(1, releases=(Release(0, 1.0),)),
        StepCommand(1, releases=(Release(0, 2**63),)),
        StepCommand(1, new_seqs=(NewSeq(0, 0, 0, 1, -1, dataclasses.replace(ok_s, seed=-1)),)),
        StepCommand(1, new_seqs=(NewSeq(0, 0, 0, 1, -1, dataclasses.replace(ok_s, top_k=1.5)),)),
        StepCommand(1, new_seqs=(NewSeq(0, 0, 0, 1, -1, dataclasses.replace(ok_s, min_p="0")),)),
        StepCommand(1, sampling_updates=(SamplingUpdate(0, 0, dataclasses.replace(
            ok_s, banned_token_ids=(1.5,))),)),
        StepCommand(1, block_updates=(BlockUpdate(0, 0, 0, (2**31,)),)),
        StepCommand(1, block_updates=(BlockUpdate(0, 0, 0, ("1",)),)),
        StepCommand(1, prefill=(PrefillRow(0, 0, 0, (1,), 1, 0, -1),)),
        StepCommand(1, prefill=(PrefillRow(0, 0, 0, (U64_MAX,), True, 0, -1),)),
        StepCommand(1, prefill=(PrefillRow(0, 0, 0, None, True, 0, -1),)),
    ]
    for cmd in bad:
        with pytest.raises(ProtocolError):
            P.encode(cmd)


# --------------------------------------------------------------------------- fuzz


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame)
    op = rng.randrange(6)
    i = rng.randrange(len(b) + 1)
    if op == 0:
        return bytes(b[:i])  # truncation
    if op == 1 and b:
        j = rng.randrange(len(b))
        b[j] ^= 1 << rng.randrange(8)  # bit flip
    elif op == 2:
        b[i:i] = rng.randbytes(rng.randrange(1, 9))  # insertion
    elif op == 3:
        del b[i:i + rng.randrange(1, 9)]  # deletion
    elif op == 4 and b:
        b[rng.randrange(len(b))] = rng.choice([0xc0, 0xc1, 0xc2, 0xc3, 0xdc, 0xdd, 0xde, 0xdf,
                                               0xc7, 0xd4, 0xcf, 0xd3, 0xcb, 0xca])  # type byte
    else:
        b += rng.randbytes(rng.randrange(1, 5))  # trailing bytes
    return bytes(b)


def _replace_somewhere(body, value, rng: random.Random):
    """body (nested lists) with one element, at a random depth, replaced by ``value`` or the
    list there lengthened/shortened (wrong field counts)."""
    node, path = body, []
    while isinstance(node, list) and node and rng.random() < 0.75:
        path.append(rng.randrange(len(node)))
        node = node[path[-1]]

    def rebuild(cur, depth):
        if depth == len(path):
            if isinstance(cur, list) and rng.random() < 0.4:
                return cur[:-1] if cur and rng.random() < 0.5 else cur + [value]
            return value
        out = list(cur)
        out[path[depth]] = rebuild(cur[path[depth]], depth + 1)
        return out

    return rebuild(body, 0)


def _count_run(fn, want: int) -> None:
    """Run the @given ``fn(counter)`` and assert it decoded at least ``want`` frames."""
    counter = [0]
    fn(counter)
    assert counter[0] >= want, f"only {counter[0]} frames decoded, want {want}"


def test_random_bytes_are_protocol_errors():
    @settings(FAST, max_examples=2000)
    @given(st.one_of(st.binary(max_size=64), st.binary(min_size=64, max_size=600)))
    def run(counter, frame):
        _decode_bounded(frame)
        counter[0] += 1

    _count_run(run, 2000)


def test_mutated_valid_frames_are_protocol_errors_or_commands():
    @settings(FAST, max_examples=1200)
    @given(seed_commands, st.randoms(use_true_random=False))
    def run(counter, cmd, rng):
        frame = P.encode(cmd)
        for _ in range(6):  # chains of mutations, every intermediate decoded
            frame = _mutate(frame, rng)
            _decode_bounded(frame)
            counter[0] += 1

    _count_run(run, 7200)


def test_valid_msgpack_of_wrong_shape_is_protocol_error():
    @settings(FAST, max_examples=500)
    @given(seed_commands, garbage, st.randoms(use_true_random=False))
    def run(counter, cmd, junk, rng):
        body = msgpack.unpackb(P.encode(cmd))
        for _ in range(3):  # the same junk grafted at three random places
            _decode_bounded(msgpack.packb(_replace_somewhere(body, junk, rng), use_bin_type=True))
        _decode_bounded(msgpack.packb(junk, use_bin_type=True))  # arbitrary values as frames
        counter[0] += 4

    _count_run(run, 2000)


def test_decode_row_values_beyond_int32_are_refused_on_encode():
    with pytest.raises(ProtocolError, match="int32"):
        StepCommand(step_id=1, decode=(DecodeRow(0, 2**31, 5, 0),))
    with pytest.raises(ProtocolError, match="int32"):
        DecodeRows(np.array([[0], [0], [2**40], [0]]))


def _ok_body() -> list:
    ok = StepCommand(step_id=1, new_seqs=(NewSeq(0, 0, 0, 1, -1,
                                                 RowSampling(1.0, 1.0, 0, 0.0, 0, (3,), None)),),
                     block_updates=(BlockUpdate(0, 0, 0, (1,)),), decode=(DecodeRow(0, 0, 5, 0),),
                     prefill=(PrefillRow(0, 1, 0, (1, 2), True, 1, -1),))
    body = msgpack.unpackb(P.encode(ok))
    assert P.decode(msgpack.packb(body, use_bin_type=True)) == ok
    return body


def _prefill_rec(**over) -> bytes:
    rec = dict(rank=0, slot=1, start=0, sample=1, output_index=1, next_token=-1, n=2)
    rec.update(over)
    return np.array([tuple(rec.values())], P.PREFILL.dtype).tobytes()


@pytest.mark.parametrize("index,value", [
    (0, 1), (0, True), (1, True), (1, 1.0), (1, "1"), (2, None), (2, b"\x00"),
    (3, [[0, 1]]), (3, []), (3, {}), (3, 5), (3, "x"), (3, msgpack.ExtType(1, b"x")),
    (3, b"\x00" * 15), (4, b"\x00" * 7), (5, b"\x00" * 3), (10, b"\x00" * 31), (10, [5]),
    (12, b"\x00" * 4), (12, b"\x00" * 12), (11, b""),  # entries the counts do not cover
    (11, _prefill_rec(sample=2)), (11, _prefill_rec(n=-1)), (11, _prefill_rec(n=3)),
    (11, _prefill_rec(n=2**62)), (11, _prefill_rec(n=-(2**63))), (11, _prefill_rec()[:-1]),
    (9, b""), (3, None), (12, 1.5),
])
def test_type_confusions_are_refused(index, value):
    body = _ok_body()
    body[index] = value
    with pytest.raises(ProtocolError):
        P.decode(msgpack.packb(body, use_bin_type=True))


def _frame(*fields) -> bytes:
    return msgpack.packb([P.PROTOCOL_VERSION, 0, 0, *fields], use_bin_type=True)


@pytest.mark.parametrize("frame", [
    b"\x91" * 100_000 + b"\xc0",  # deep array nesting
    b"\x81\xa1a" * 50_000 + b"\xc0",  # deep map nesting
    b"\x9d\x02\x00\x00" + b"\x91" * 100_000 + b"\xc0",  # ... where a field belongs
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",  # huge lengths
    b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x05",  # huge str / ext
    b"\x9d\x02\x00\x00\xc6\xff\xff\xff\xff", b"\x9d\x02\x00\x00\xdd\xff\xff\xff\xff\x90",
    msgpack.packb({1: 2}), msgpack.packb({b"k": 2}), msgpack.packb([{(1,): 2}]),
    b"\xc7\x0c\xff" + b"\xff" * 12, b"\xc7\x05\xff" + bytes(5),  # malformed timestamp ext
    msgpack.packb([P.PROTOCOL_VERSION + 1, 0, 0] + [b""] * 12, use_bin_type=True),  # next version
    msgpack.packb([1, 0, 0, [], [], [], [], b"", []], use_bin_type=True),  # version 1's layout
    _frame(*[b""] * 12) + b"\x00",  # trailing byte
    _frame(*[b""] * 11), _frame(*[b""] * 13),  # a field missing, one too many
    _frame(*[b""] * 11, ""), _frame(*[b""] * 11, 0), _frame(*[b""] * 11, None),
    b"\xa3\xff\xfe\xfd", b"", b"\xc1", b"\x90", b"\x9d", b"\x9d\xc0",
])
def test_known_hostile_frames(frame):
    assert _decode_bounded(frame) is None


def test_non_bytes_input_is_protocol_error():
    for v in (None, "frame", [1, 2], 3):
        with pytest.raises(ProtocolError):
            P.decode(v)


def test_oversize_frames_are_refused_both_ways(monkeypatch):
    big = StepCommand(step_id=1, decode=tuple(DecodeRow(0, i, i, i) for i in range(200)))
    frame = P.encode(big)
    monkeypatch.setattr(P, "MAX_FRAME_BYTES", len(frame) - 1)
    with pytest.raises(ProtocolError):
        P.encode(big)
    with pytest.raises(ProtocolError):
        P.decode(frame)
    monkeypatch.setattr(P, "MAX_FRAME_BYTES", len(frame))
    assert P.decode(P.encode(big)) == big


def test_real_limit_frame_just_over_is_refused():
    with pytest.raises(ProtocolError):
        _ = P.decode(bytes(P.MAX_FRAME_BYTES + 1))
