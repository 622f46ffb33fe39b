"""No frame costs either EP decoder (commands, rank results) more than 4x its size in memory.

Issue 14: a 16 MB frame of empty msgpack arrays once cost 1.2 GB and 12 s before the decoder
refused it. Every decode here runs under ``tracemalloc`` and must end in a ``ProtocolError``
or a valid value (every row of it buildable) with a peak of at most ``4 * len(frame)`` plus a
fixed 256 KiB; the multi-MB frames must also be quick. Also: results round-trip, both encoders
refuse oversized frames, and ``WireLimits`` caps what a correct leader never exceeds.
"""

from __future__ import annotations

import math
import random
import time
import tracemalloc
from itertools import islice

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from epserve.models.traits import PromptTokenLogprob, RowSampling, SampledToken
from epserve.worker import ep_results as R
from epserve.worker import step_command as P
from epserve.worker.step_command import (BlockUpdate, DecodeRow, NewSeq, PrefillRow, ProtocolError,
                                     Release, StepCommand, WireLimits)

FAST = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
ALLOWANCE = 256 * 2**10
MB = 2**20
V = P.PROTOCOL_VERSION


def _touch(out, limit: int = 2000) -> None:
    """Build (up to ``limit`` of each kind) the rows a decoded value holds, as consumers do."""
    if isinstance(out, StepCommand):
        for rows in (out.releases, out.new_seqs, out.sampling_updates, out.block_updates,
                     out.prefill):
            for row in islice(rows, limit):
                list(getattr(row, "tokens", getattr(row, "blocks", ())))
    else:
        for m in (out.sampled, out.prompt_logprobs):
            for slot in islice(m, limit):
                m[slot]


def _bounded(decode, frame: bytes, seconds: float = 1.0):
    """decode(frame) under tracemalloc: the value or None on ProtocolError (any other exception
    escapes); asserts the peak and the time (tracing only the decode: hypothesis runs untraced)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        out = decode(frame)
    except ProtocolError:
        out = None
    finally:
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= 4 * len(frame) + ALLOWANCE, f"{len(frame)} bytes cost {peak} to decode"
    assert took < seconds, f"{len(frame)} bytes took {took:.2f} s to decode"
    if out is not None:
        _touch(out)
    return out


DECODERS = {"command": P.decode, "result": R.decode_result}


def _valid_fields(which: str) -> list:
    if which == "result":
        res = R.RankResult(3, 1, {2: SampledToken(5, -0.5, ((5, -0.5),))},
                           {2: [PromptTokenLogprob(7, -1.0)]})
        return msgpack.unpackb(R.encode_result(res))
    s = RowSampling(1.0, 1.0, 0, 0.0, 0, (3,), None)
    cmd = StepCommand(step_id=1, releases=(Release(0, 1),), new_seqs=(NewSeq(0, 0, 0, 1, -1, s),),
                      block_updates=(BlockUpdate(0, 0, 0, (1,)),), decode=(DecodeRow(0, 0, 5, 0),),
                      prefill=(PrefillRow(0, 1, 0, (1, 2), True, 1, -1),))
    return msgpack.unpackb(P.encode(cmd))


def _hostile(kind: str, n: int) -> bytes:
    """One msgpack value that a generic unpacker would inflate (or try to) from ~n bytes."""
    big = (n + 1).to_bytes(4, "big")
    return {
        "empty_arrays": b"\xdd" + big + b"\x90" * (n + 1),
        "empty_maps": b"\xdd" + big + b"\x80" * (n + 1),
        "nested": b"\x91" * n + b"\xc0",
        "strs": b"\xdd" + big + b"\xa1a" * (n + 1),
        "exts": b"\xdd" + big + b"\xd4\x01\x00" * (n + 1),
        "floats": b"\xdd" + big + (b"\xcb" + bytes(8)) * (n + 1),
        "ints": b"\xdd" + big + (b"\xd3" + bytes(8)) * (n + 1),
        "huge_array": b"\xdd\xff\xff\xff\xff" + b"\x90" * n,
        "huge_map": b"\xdf\xff\xff\xff\xff" + b"\x80" * n,
        "huge_bin": b"\xc6\xff\xff\xff\xff" + bytes(n),
        "huge_str": b"\xdb\xff\xff\xff\xff" + b"a" * n,
        "huge_ext": b"\xc9\xff\xff\xff\xff\x01" + bytes(n),
        "short_bin": b"\xc6" + (2 * n).to_bytes(4, "big") + bytes(n),
    }[kind]


KINDS = ["empty_arrays", "empty_maps", "nested", "strs", "exts", "floats", "ints", "huge_array",
         "huge_map", "huge_bin", "huge_str", "huge_ext", "short_bin"]


def _graft(fields: list, at: int | None, value: bytes) -> bytes:
    """A frame whose field ``at`` (or, for None, the whole frame) is the raw msgpack ``value``."""
    if at is None:
        return value
    parts = [msgpack.packb(f, use_bin_type=True) for f in fields]
    parts[at] = value
    return bytes([0x90 | len(fields)]) + b"".join(parts)


# --------------------------------------------------------------------------- hostile frames


@settings(FAST, max_examples=150)
@given(st.sampled_from(sorted(DECODERS)), st.sampled_from(KINDS), st.integers(1, 60_000),
       st.data())
def test_hostile_values_anywhere_cost_at_most_4x(which, kind, n, data):
    fields = _valid_fields(which)
    at = data.draw(st.one_of(st.none(), st.integers(0, len(fields) - 1)))
    frame = _graft(fields, at, _hostile(kind, n))
    assert _bounded(DECODERS[which], frame) is None


@pytest.mark.parametrize("which", sorted(DECODERS))
@pytest.mark.parametrize("at", [None, 3])
def test_a_16_mib_frame_of_empty_arrays_is_refused_at_once(which, at):
    frame = _graft(_valid_fields(which), at, _hostile("empty_arrays", 16 * MB - 16))
    assert len(frame) > 16 * MB - 64
    assert _bounded(DECODERS[which], frame, seconds=2.0) is None


def test_truncated_frames_are_refused():
    frame = P.encode(StepCommand(step_id=1, block_updates=(BlockUpdate(0, 0, 0, tuple(range(64))),),
                                 decode=tuple(DecodeRow(0, i, i, 0) for i in range(64))))
    for cut in range(len(frame)):
        assert _bounded(P.decode, frame[:cut]) is None
    res = R.encode_result(R.RankResult(1, 0, {i: SampledToken(i, -1.0, ((i, -1.0),) * 3)
                                              for i in range(16)}, {}))
    for cut in range(len(res)):
        assert _bounded(R.decode_result, res[:cut]) is None


def _big_command(rng: random.Random, rows: int) -> StepCommand:
    s = RowSampling(0.5, 1.0, 3, 0.0, 7, tuple(range(rng.randrange(4))), 2)
    return StepCommand(
        step_id=rng.randrange(100), releases=tuple(Release(0, i) for i in range(rows)),
        new_seqs=tuple(NewSeq(0, i, 0, 9, -1, s) for i in range(rows)),
        block_updates=tuple(BlockUpdate(0, i, 0, tuple(range(i % 7))) for i in range(rows)),
        decode=tuple(DecodeRow(0, i, i, 0) for i in range(rows)),
        prefill=tuple(PrefillRow(0, i, 0, tuple(range(i % 9)), i % 2 == 0, 0, -1)
                      for i in range(rows)))


BIG_FRAMES = [P.encode(_big_command(random.Random(k), 50 * k)) for k in (1, 4, 16)]


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    b = bytearray(frame)
    i = rng.randrange(len(b))
    op = rng.randrange(4)
    if op == 0:
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1:
        b[i] = rng.choice([0x90, 0x80, 0xa0, 0xc4, 0xc6, 0xdc, 0xdd, 0xde, 0xdf, 0xc7, 0xd4, 0xcb])
    elif op == 2:
        b[i:i + rng.randrange(1, 9)] = b""
    else:
        b[i:i] = rng.randbytes(rng.randrange(1, 9))
    return bytes(b)


@settings(FAST, max_examples=300)
@given(st.sampled_from(BIG_FRAMES), st.randoms(use_true_random=False))
def test_mutated_big_frames_cost_at_most_4x(frame, rng):
    for _ in range(3):
        frame = _mutate(frame, rng)
        _bounded(P.decode, frame)


def _bins(**bins) -> bytes:
    order = ["rel", "new", "new_ids", "upd", "upd_ids", "blk", "blk_ids", "dec", "pre", "pre_ids",
             "msk", "msk_ids", "rew", "ver", "ver_ids"]
    return msgpack.packb([V, 0, 0] + [bins.get(k, b"") for k in order] + [0, bins.get("drop",
                                                                                b"")],
                         use_bin_type=True)


def _recs(spec, n: int, count: int = 0) -> bytes:
    """n records of ``spec``, slots rising, ``count`` entries each."""
    recs = np.zeros(n, spec.dtype)
    recs["slot"] = np.arange(n)
    if count:
        recs["n"] = count
    return recs.tobytes()


@pytest.mark.parametrize("which,make", [
    ("command", lambda n: _bins(dec=bytes(n))),
    ("command", lambda n: _bins(rel=bytes(n))),
    ("command", lambda n: _bins(new=_recs(P.NEW_SEQS, n // 96, 1), new_ids=bytes(4 * (n // 96)))),
    ("command", lambda n: _bins(pre=_recs(P.PREFILL, 1, n // 4), pre_ids=bytes(4 * (n // 4)))),
    ("command", lambda n: _bins(blk=_recs(P.BLOCK_UPDATES, n // 40, 1),
                                blk_ids=bytes(4 * (n // 40)))),
    ("command", lambda n: _bins(msk=_recs(P.TOKEN_MASKS, 1, n // 4), msk_ids=bytes(4 * (n // 4)))),
    ("command", lambda n: _bins(rew=bytes(n))),
    ("command", lambda n: _bins(drop=bytes(n))),
    ("command", lambda n: _bins(ver=_recs(P.VERIFY, n // 44, 1), ver_ids=bytes(4 * (n // 44)))),
    ("result", lambda n: msgpack.packb([V, 0, 0, _recs(R.SAMPLED, n // 48, 1),
                                        bytes(16 * (n // 48)), b"", b"", b"", b"", b"", b""])),
    ("result", lambda n: msgpack.packb([V, 0, 0, b"", b"", _recs(R.PROMPT, n // 48, 1),
                                        bytes(16 * (n // 48)), b"", b"", b"", b""])),
    ("result", lambda n: msgpack.packb([V, 0, 0, b"", b"", b"", b"",
                                        _recs(R.VERIFIED, n // 48, 1), bytes(16 * (n // 48)),
                                        b"", b""])),
    ("result", lambda n: msgpack.packb([V, 0, 0, b"", b"", b"", b"", b"", b"",
                                        _recs(R.DRAFTS, n // 80, 16),
                                        bytes(64 * (n // 80))])),
], ids=["decode", "releases", "new_seqs", "tokens", "blocks", "masks", "rewinds", "dropped",
        "verify",
        "sampled", "prompt", "verified", "drafts"])
def test_big_well_formed_frames_cost_at_most_4x(which, make):
    """Frames the layout accepts (millions of rows, ids or alternatives) decode within bounds:
    their rows stay records until read."""
    frame = make(4 * MB)
    assert _bounded(DECODERS[which], frame, seconds=2.0) is not None


# --------------------------------------------------------------------------- limits


LIMITS = WireLimits(world_size=2, max_slots=4, max_blocks_per_seq=3, max_step_tokens=10)


def test_limits_refuse_what_no_correct_leader_sends():
    s = RowSampling(1.0, 1.0, 0, 0.0, 0, (), None)
    fine = StepCommand(1, releases=tuple(Release(r, i) for r in range(2) for i in range(4)),
                       block_updates=(BlockUpdate(0, 0, 0, (1, 2, 3)),),
                       decode=tuple(DecodeRow(0, i, 1, 0) for i in range(4)),
                       prefill=tuple(PrefillRow(1, i, 0, (1, 2), True, 0, -1) for i in range(4)))
    assert P.decode(P.encode(fine), LIMITS) == fine
    over = [
        StepCommand(1, releases=tuple(Release(0, i) for i in range(9))),
        StepCommand(1, new_seqs=tuple(NewSeq(0, i, 0, 1, -1, s) for i in range(9))),
        StepCommand(1, block_updates=(BlockUpdate(0, 0, 0, (1, 2, 3, 4)),)),
        StepCommand(1, decode=tuple(DecodeRow(0, i, 1, 0) for i in range(9))),
        StepCommand(1, decode=tuple(DecodeRow(0, i, 1, 0) for i in range(5)),
                    prefill=tuple(PrefillRow(1, i, 0, (1,), True, 0, -1) for i in range(4))),
        StepCommand(1, prefill=(PrefillRow(1, 0, 0, tuple(range(11)), True, 0, -1),)),
    ]
    for cmd in over:
        P.decode(P.encode(cmd))  # well formed without limits
        with pytest.raises(ProtocolError):
            P.decode(P.encode(cmd), LIMITS)


def test_result_limits_and_the_logprob_cap():
    ok = R.RankResult(1, 0, {i: SampledToken(1, -1.0, ((1, -1.0),) * 20) for i in range(4)},
                      {0: [PromptTokenLogprob(1, -1.0)] * 10})
    assert R.decode_result(R.encode_result(ok), LIMITS) == ok
    for bad in (R.RankResult(1, 0, {i: SampledToken(1) for i in range(5)}, {}),
                R.RankResult(1, 0, {}, {0: [PromptTokenLogprob(1, -1.0)] * 11})):
        R.decode_result(R.encode_result(bad))
        with pytest.raises(ProtocolError):
            R.decode_result(R.encode_result(bad), LIMITS)
    wide = R.RankResult(1, 0, {0: SampledToken(1, -1.0, ((1, -1.0),) * 21)}, {})
    with pytest.raises(ProtocolError):  # more alternatives than any request may ask for
        R.decode_result(R.encode_result(wide))


# --------------------------------------------------------------------------- results


lps = st.floats(allow_nan=False)
tops = st.lists(st.tuples(st.integers(-(2**63), 2**63 - 1), lps), max_size=20).map(tuple)
ranks = st.none() | st.integers(1, 2**63 - 1)
results = st.builds(
    R.RankResult, st.integers(-(2**63), 2**64 - 1), st.integers(-(2**63), 2**64 - 1),
    st.dictionaries(st.integers(-(2**63), 2**63 - 1), st.builds(SampledToken, st.integers(0, 2**40),
                                                                lps, tops, ranks), max_size=6),
    st.dictionaries(st.integers(-5, 300), st.lists(st.builds(PromptTokenLogprob, st.integers(
        0, 2**40), lps, tops, ranks), min_size=1, max_size=5), max_size=4))


@settings(FAST, max_examples=150)
@given(results)
def test_results_round_trip(res):
    out = R.decode_result(R.encode_result(res))
    assert out == res and res == out
    assert sorted(out.sampled) == sorted(res.sampled) and len(out.prompt_logprobs) == len(
        res.prompt_logprobs)
    for slot, tok in res.sampled.items():
        got = out.sampled[slot]
        assert type(got.token_id) is int and type(got.logprob) is float and got.top == tok.top
        assert got.rank == tok.rank
    assert out.sampled.get(2**70) is None and out.prompt_logprobs.get(-99, ()) == ()


def test_result_lookups_past_the_cache(monkeypatch):
    monkeypatch.setattr(R, "_CACHE_ROWS", 2)
    res = R.RankResult(0, 0, {i: SampledToken(i, -math.inf) for i in range(0, 20, 2)},
                       {3: [PromptTokenLogprob(1, -1.0)] * 3, 5: [PromptTokenLogprob(2, -2.0)]})
    out = R.decode_result(R.encode_result(res))
    assert out.sampled[4] == SampledToken(4, -math.inf) and 5 not in out.sampled
    assert out.prompt_logprobs[3] == [PromptTokenLogprob(1, -1.0)] * 3
    assert 4 not in out.prompt_logprobs
    assert list(out.prompt_logprobs) == [3, 5] and out == res


def test_results_out_of_slot_order_are_refused():
    rec = np.zeros(2, R.SAMPLED.dtype)
    for slots in ((3, 3), (4, 3)):
        rec["slot"] = slots
        with pytest.raises(ProtocolError):
            R.decode_result(msgpack.packb([V, 0, 0, rec.tobytes(), b"", b"", b""]))
    rec["slot"] = (4, 3)
    with pytest.raises(ProtocolError):
        R.decode_result(msgpack.packb([V, 0, 0, b"", b"", rec.tobytes(), b""]))
    for frame in (msgpack.packb([V, 0, 0, [[1, 2, 0.5, []]], []]), b"\x97" + b"\x02" * 7,
                  msgpack.packb([V, 0, 0, b"", b"", b"", b""]) + b"\x00", None, "x"):
        with pytest.raises(ProtocolError):
            R.decode_result(frame)


def test_oversize_results_are_refused_both_ways(monkeypatch):
    res = R.RankResult(1, 0, {i: SampledToken(i, -1.0) for i in range(100)}, {})
    frame = R.encode_result(res)
    monkeypatch.setattr(R, "MAX_FRAME_BYTES", len(frame) - 1)
    with pytest.raises(ProtocolError):
        R.encode_result(res)
    with pytest.raises(ProtocolError):
        R.decode_result(frame)
    monkeypatch.setattr(R, "MAX_FRAME_BYTES", len(frame))
    assert R.decode_result(R.encode_result(res)) == res
