"""Family 5 of bench/hostile_probe.py: the EP step-command and rank-result decoders under
mutated, random and hostile frames (no server).

Frames: valid ones from ``encode`` / ``encode_result`` with byte flips, msgpack type bytes,
truncations, insertions, deletions, duplicated slices and splices; pure random bytes; hostile
msgpack structures (millions of empty containers, huge declared lengths, deep nesting) grafted
in as the whole frame or as one field; each also decoded under ``WireLimits`` at times. The
contract (``worker.protocol``): ``ProtocolError`` and nothing else for anything malformed, and
decoding costs at most about 3x the frame (the test suite holds it to 4x + 256 KiB). An
accepted frame has every row built (as the ranks read them), which must not raise either.
"""

from __future__ import annotations

import random
import time
import tracemalloc
from itertools import islice

import msgpack
import numpy as np

from epserve.models.traits import PromptTokenLogprob, RowSampling, SampledToken
from epserve.worker import ep_results as R
from epserve.worker import step_command as P
from epserve.worker.step_command import (BlockUpdate, DecodeRow, NewSeq, PrefillRow, ProtocolError,
                                     Release, SamplingUpdate, StepCommand, WireLimits)

ALLOWANCE = 256 << 10
LIMITS = WireLimits(world_size=2, max_slots=64, max_blocks_per_seq=256, max_step_tokens=2048)


def _command(rng: random.Random, rows: int) -> StepCommand:
    s = RowSampling(rng.random(), 1.0, rng.randrange(50), 0.0, rng.randrange(2**64),
                    tuple(rng.randrange(2048) for _ in range(rng.randrange(4))),
                    rng.choice([None, *range(21)]))
    return StepCommand(
        step_id=rng.randrange(2**40), releases=tuple(Release(0, i) for i in range(rows % 5)),
        new_seqs=tuple(NewSeq(i % 2, i, 0, 9, -1, s) for i in range(rows)),
        sampling_updates=tuple(SamplingUpdate(1, i, s) for i in range(rows % 3)),
        block_updates=tuple(BlockUpdate(0, i, 0, tuple(range(i % 7))) for i in range(rows)),
        decode=tuple(DecodeRow(i % 2, i, rng.randrange(-1, 2048), 0) for i in range(rows)),
        prefill=tuple(PrefillRow(1, i, 0, tuple(range(i % 9)), i % 2 == 0, 0, -1)
                      for i in range(rows)))


def _result(rng: random.Random, rows: int) -> R.RankResult:
    top = tuple((rng.randrange(2048), -rng.random()) for _ in range(rng.randrange(21)))
    return R.RankResult(rng.randrange(2**40), 1,
                        {i: SampledToken(rng.randrange(2048), -1.0, top) for i in range(rows)},
                        {i: [PromptTokenLogprob(5, -0.5, top)] * (i % 4) for i in range(rows)})


def _hostile(kind: str, n: int) -> bytes:
    big = (n + 1).to_bytes(4, "big")
    return {"empty_arrays": b"\xdd" + big + b"\x90" * (n + 1),
            "empty_maps": b"\xdd" + big + b"\x80" * (n + 1),
            "nested": b"\x91" * n + b"\xc0", "strs": b"\xdd" + big + b"\xa1a" * (n + 1),
            "exts": b"\xdd" + big + b"\xd4\x01\x00" * (n + 1),
            "huge_array": b"\xdd\xff\xff\xff\xff" + b"\x90" * n,
            "huge_map": b"\xdf\xff\xff\xff\xff" + b"\x80" * n,
            "huge_bin": b"\xc6\xff\xff\xff\xff" + bytes(n),
            "huge_str": b"\xdb\xff\xff\xff\xff" + b"a" * n,
            "short_bin": b"\xc6" + (2 * n).to_bytes(4, "big") + bytes(n)}[kind]


HOSTILE = ["empty_arrays", "empty_maps", "nested", "strs", "exts", "huge_array", "huge_map",
           "huge_bin", "huge_str", "short_bin"]
TYPE_BYTES = [0x90, 0x80, 0xa0, 0xc0, 0xc4, 0xc6, 0xdc, 0xdd, 0xde, 0xdf, 0xc7, 0xd4, 0xcb,
              0xcf, 0xd3, 0xff]


def _mutate(frame: bytes, rng: random.Random, other: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(b) + 1)
        op = rng.randrange(8)
        if op == 0 and b:
            b[min(i, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[min(i, len(b) - 1)] = rng.choice(TYPE_BYTES)
        elif op == 2:
            del b[i:]
        elif op == 3:
            b[i:i] = rng.randbytes(rng.randrange(1, 17))
        elif op == 4:
            del b[i:i + rng.randrange(1, 17)]
        elif op == 5:
            j = rng.randrange(len(b) + 1)
            b[i:i] = b[min(i, j):max(i, j)][:4096]
        elif op == 6:  # splice with another frame
            b = b[:i] + other[rng.randrange(len(other) + 1):]
        elif b:
            b[min(i, len(b) - 1)] = rng.randrange(256)
    return bytes(b)


def _graft(frame: bytes, rng: random.Random) -> bytes:
    kind, n = rng.choice(HOSTILE), rng.choice([1, 100, 10_000, 200_000])
    value = _hostile(kind, n)
    if rng.random() < 0.3:
        return value
    fields = msgpack.unpackb(frame)
    parts = [msgpack.packb(f, use_bin_type=True) for f in fields]
    parts[rng.randrange(len(parts))] = value
    return bytes([0x90 | len(parts)]) + b"".join(parts)


def _structured(rng: random.Random, which: str) -> bytes:
    """A frame of the right layout whose records are random bytes (entry counts and bools
    made consistent most of the time), to reach the checks past the layout."""
    specs = [P.RELEASES, P.NEW_SEQS, P.SAMPLING_UPDATES, P.BLOCK_UPDATES, None, P.PREFILL] \
        if which == "command" else [R.SAMPLED, R.PROMPT]
    bins: list[bytes] = []
    for spec in specs:
        if spec is None:  # the decode rows: int32 columns
            bins.append(rng.randbytes(16 * rng.randrange(8)))
            continue
        rows = rng.randrange(6)
        recs = np.frombuffer(rng.randbytes(rows * spec.dtype.itemsize), spec.dtype).copy()
        for name in spec.bools:
            if rng.random() < 0.8:
                recs[name] &= 1
        counts = [rng.randrange(4) for _ in range(rows)]
        if spec.flat is not None and rng.random() < 0.8:
            recs["n"] = counts
        bins.append(recs.tobytes())
        if spec.flat is not None:
            bins.append(rng.randbytes(sum(counts) * spec.flat.itemsize))
    head = [P.PROTOCOL_VERSION, rng.randrange(2**63), rng.choice([0, 1, rng.randrange(2**31)])]
    return msgpack.packb(head + bins, use_bin_type=True)


def _frames(rng: random.Random, n: int):
    """(decoder name, label, frame, limits or None), ``n`` of them."""
    cmds = [P.encode(_command(rng, r)) for r in (0, 1, 3, 10, 40, 120)]
    ress = [R.encode_result(_result(rng, r)) for r in (0, 1, 3, 10, 40)]
    for i in range(n):
        which = "command" if i % 2 == 0 else "result"
        base = rng.choice(cmds if which == "command" else ress)
        r = rng.random()
        if r < 0.7:
            label, frame = "mutated", _mutate(base, rng, rng.choice(cmds + ress))
        elif r < 0.8:
            label, frame = "random", rng.randbytes(rng.randrange(0, 512))
        elif r < 0.88:
            label, frame = "random records", _structured(rng, which)
        elif r < 0.97:
            label, frame = "hostile", _graft(base, rng)
        else:
            label, frame = "valid", base
        if rng.random() < 0.1:  # a frame of the other kind
            which = "result" if which == "command" else "command"
        yield which, label, frame, (LIMITS if rng.random() < 0.3 else None)


def _decode(fn, frame: bytes, limits):
    """(value or None, outcome, peak bytes, seconds) of one decode under tracemalloc."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    try:
        out, kind = fn(frame, limits), "accepted"
    except ProtocolError:
        out, kind = None, "ProtocolError"
    except Exception as exc:  # the finding: nothing but ProtocolError may escape
        out, kind = None, f"{type(exc).__name__}: {str(exc)[:80]}"
    took = time.perf_counter() - t0
    return out, kind, tracemalloc.get_traced_memory()[1] - base, took


def _touch(out) -> str | None:
    """Build the rows of an accepted value as the ranks do; what raised, or None."""
    try:
        if isinstance(out, StepCommand):
            list(islice(out.decode, 2000))
            for rows in (out.releases, out.new_seqs, out.sampling_updates, out.block_updates,
                         out.prefill):
                for row in islice(rows, 2000):
                    list(getattr(row, "tokens", getattr(row, "blocks", ())))
                    getattr(row, "sampling", None)
        else:
            for m in (out.sampled, out.prompt_logprobs):
                for slot in islice(m, 2000):
                    m[slot]
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:80]}"
    return None


def run(tally, n: int) -> None:
    rng = random.Random(5)
    fns = {"command": P.decode, "result": R.decode_result}
    stats = {w: {"kinds": {}, "ratio": 0.0, "slow": 0.0} for w in fns}
    tracemalloc.start()
    try:
        for which, label, frame, limits in _frames(rng, n):
            row = tally.row(f"fuzz-{which}")
            row.http = False
            row.tried += 1
            out, kind, peak, took = _decode(fns[which], frame, limits)
            s = stats[which]
            outcome = "other" if kind not in ("accepted", "ProtocolError") else kind
            s["kinds"][outcome] = s["kinds"].get(outcome, 0) + 1
            s["slow"] = max(s["slow"], took)
            if len(frame) >= 64 << 10:  # below, the decoder's fixed few KiB dominate
                s["ratio"] = max(s["ratio"], peak / len(frame))
                s["big"] = s.get("big", 0) + 1
            repro = f"{label} frame of {len(frame)} bytes, limits={limits is not None}: " \
                    f"{frame[:48]!r}"
            if outcome == "other":
                tally.mismatch(row.name, f"decode raised {kind.split(':')[0]}", repro, kind)
            if peak > 4 * len(frame) + ALLOWANCE:
                tally.mismatch(row.name, "decode cost over 4x + 256 KiB", repro,
                               f"peak {peak} bytes")
            if out is not None and (err := _touch(out)):
                tally.mismatch(row.name, "accepted, then building its rows raised", repro, err)
    finally:
        tracemalloc.stop()
    for which, s in stats.items():
        k = s["kinds"]
        tally.note(f"fuzz-{which}", f"ProtocolError {k.get('ProtocolError', 0)}, other "
                   f"{k.get('other', 0)}, accepted {k.get('accepted', 0)}; peak <= "
                   f"{s['ratio']:.2f}x frame over {s.get('big', 0)} frames >= 64 KiB; slowest "
                   f"{s['slow'] * 1e3:.1f}ms")
