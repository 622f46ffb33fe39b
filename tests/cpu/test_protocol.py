"""The StepCommand codec: every command shape round-trips; any malformed frame is a ProtocolError.

The fuzz tests count the frames they decode and assert what they promise (2,000 random byte
strings, 7,200 mutated valid frames, 2,000 valid msgpack values of the wrong shape: 11,200),
each decode bounded in time.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import fields, is_dataclass

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from epserve.worker import protocol as P
from epserve.worker.protocol import (BlockUpdate, DecodeRow, NewSeq, PrefillRow, ProtocolError,
                                     Release, Sampling, SamplingUpdate, StepCommand)

FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
I64_MIN, U64_MAX = -(2**63), 2**64 - 1

# --------------------------------------------------------------------------- strategies

wire_ints = st.one_of(st.integers(-3, 300), st.integers(I64_MIN, U64_MAX),
                      st.sampled_from([I64_MIN, U64_MAX, 2**63, 2**32, -(2**31), P.FEED_DEVICE]))
# decode rows travel as int32 columns
row_ints = st.one_of(st.integers(-3, 300), st.integers(-(2**31), 2**31 - 1),
                     st.sampled_from([-(2**31), 2**31 - 1, 2**16, P.FEED_DEVICE]))
wire_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                        st.sampled_from([math.inf, -math.inf, math.nan, -0.0, 5e-324]))
small = dict(max_size=4)

samplings = st.builds(Sampling, wire_floats, wire_floats, wire_ints, wire_floats, wire_ints,
                      st.lists(wire_ints, **small).map(tuple), wire_ints)
step_commands = st.builds(
    StepCommand,
    step_id=wire_ints, kind=wire_ints,
    releases=st.lists(st.builds(Release, wire_ints, wire_ints), **small).map(tuple),
    new_seqs=st.lists(st.builds(NewSeq, wire_ints, wire_ints, wire_ints, wire_ints, wire_ints,
                                samplings), **small).map(tuple),
    sampling_updates=st.lists(st.builds(SamplingUpdate, wire_ints, wire_ints, samplings),
                              **small).map(tuple),
    block_updates=st.lists(st.builds(BlockUpdate, wire_ints, wire_ints, wire_ints,
                                     st.lists(wire_ints, max_size=6).map(tuple)),
                           **small).map(tuple),
    decode=st.lists(st.builds(DecodeRow, row_ints, row_ints, row_ints, row_ints),
                    max_size=6).map(tuple),
    prefill=st.lists(st.builds(PrefillRow, wire_ints, wire_ints, wire_ints,
                               st.lists(wire_ints, max_size=6).map(tuple), st.booleans(),
                               wire_ints, wire_ints), **small).map(tuple),
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
        return rng.choice([0, 1, 7, -1, 300, 2**40, U64_MAX, I64_MIN])

    def i64():  # decode rows travel as int32 columns
        return rng.choice([0, 1, 7, -1, 300, 2**20, 2**31 - 1, -(2**31)])

    def many(make, k=3):
        return tuple(make() for _ in range(rng.randrange(k + 1)))

    def samp():
        return Sampling(rng.random(), 1.0, i(), math.inf, i(), many(i), i())

    return StepCommand(
        step_id=i(), kind=i(), releases=many(lambda: Release(i(), i())),
        new_seqs=many(lambda: NewSeq(i(), i(), i(), i(), i(), samp())),
        sampling_updates=many(lambda: SamplingUpdate(i(), i(), samp())),
        block_updates=many(lambda: BlockUpdate(i(), i(), i(), many(i, 5))),
        decode=many(lambda: DecodeRow(i64(), i64(), i64(), i64()), 6),
        prefill=many(lambda: PrefillRow(i(), i(), i(), many(i, 5), rng.random() < 0.5, i(), i())))


SEED_COMMANDS = [_random_command(random.Random(n)) for n in range(64)]
seed_commands = st.sampled_from(SEED_COMMANDS)


def _same(a, b) -> bool:
    """Structural equality where nan equals nan (nan != nan under ==)."""
    if is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in fields(a))
    if isinstance(a, tuple):
        return type(b) is tuple and len(a) == len(b) and all(map(_same, a, b))
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
    return out


# --------------------------------------------------------------------------- round trip


@settings(FAST, max_examples=400)
@given(step_commands)
def test_every_command_shape_round_trips(cmd):
    assert _same(P.decode(P.encode(cmd)), cmd)


def test_seed_commands_round_trip():
    assert all(_same(P.decode(P.encode(c)), c) for c in SEED_COMMANDS)


def test_round_trip_examples():
    s = Sampling(math.nan, math.inf, -1, -math.inf, U64_MAX, (), -1)
    empty = StepCommand(step_id=0)
    full = StepCommand(
        step_id=I64_MIN, kind=P.KIND_SHUTDOWN, releases=(Release(0, 1),),
        new_seqs=(NewSeq(1, 2, 0, 7, -1, s),), sampling_updates=(SamplingUpdate(1, 2, s),),
        block_updates=(BlockUpdate(1, 2, 0, tuple(range(100))),),
        decode=(DecodeRow(0, 3, P.FEED_DEVICE, 0), DecodeRow(1, 2, -7, 1)),
        prefill=(PrefillRow(1, 2, 5, (), True, 2, -1), PrefillRow(0, 0, 0, (U64_MAX,), False, 3, 9)))
    for cmd in (empty, full):
        out = P.decode(P.encode(cmd))
        assert _same(out, cmd)
        assert out.decode == cmd.decode
        assert all(type(p.sample) is bool for p in out.prefill)
    assert math.isnan(P.decode(P.encode(full)).new_seqs[0].sampling.temperature)


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


@pytest.mark.parametrize("field,value", [
    ((0,), 2), ((0,), True), ((1,), True), ((1,), 1.0), ((1,), "1"), ((2,), None),
    ((7,), b"\x00" * 31), ((7,), [[0, 0, 5, 0]]), ((8, 0, 4), 1), ((8, 0, 4), 0), ((8, 0, 3), (1, 2.0)),
    ((4, 0, 5, 0), "hot"), ((4, 0, 5, 5), [True]), ((6, 0, 3), {"a": 1}),
    ((7,), msgpack.ExtType(1, b"x")), ((3,), [[0]]), ((3,), [[0, 1, 2]]), ((7,), [5]),
])
def test_type_confusions_are_refused(field, value):
    ok = StepCommand(step_id=1, new_seqs=(NewSeq(0, 0, 0, 1, -1, Sampling(1.0, 1.0, 0, 0.0, 0, (), -1)),),
                     block_updates=(BlockUpdate(0, 0, 0, (1,)),), decode=(DecodeRow(0, 0, 5, 0),),
                     prefill=(PrefillRow(0, 1, 0, (1, 2), True, 1, -1),))
    body = msgpack.unpackb(P.encode(ok))
    node = body
    for i in field[:-1]:
        node = node[i]
    node[field[-1]] = list(value) if isinstance(value, tuple) else value
    with pytest.raises(ProtocolError):
        P.decode(msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize("frame", [
    b"\x91" * 100_000 + b"\xc0",  # deep array nesting
    b"\x81\xa1a" * 50_000 + b"\xc0",  # deep map nesting
    b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",  # huge lengths
    b"\xdb\xff\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x05",  # huge str / ext
    msgpack.packb({1: 2}), msgpack.packb({b"k": 2}), msgpack.packb([{(1,): 2}]),
    b"\xc7\x0c\xff" + b"\xff" * 12, b"\xc7\x05\xff" + bytes(5),  # malformed timestamp ext
    msgpack.packb([P.PROTOCOL_VERSION + 1, 0, 0, [], [], [], [], [], []]),  # other version
    msgpack.packb([P.PROTOCOL_VERSION, 0, 0, [], [], [], [], [], []]) + b"\x00",  # trailing
    b"\xa3\xff\xfe\xfd", b"", b"\xc1",
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
