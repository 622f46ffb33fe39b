"""A steady decode batch travels as a repeat of the last step's rows (``StepCommand.repeat``):
what a user sees is unchanged (a seeded request draws the same tokens whatever its batch-mates
do, as they finish or arrive), the command carries no per-row bytes for the rows that repeat,
and every rank resolves a repeat exactly as the explicit rows it stands for, or refuses it
with ``EpCommandFailed`` naming the sequence."""

from __future__ import annotations

import numpy as np
import pytest

from epserve import SamplingParams
from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker import step_command as P
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import (
    FEED_DEVICE, BlockUpdate, DecodeRow, NewSeq, PrefillRow, ProtocolError, Release,
    StepCommand,
)

PROMPTS = [[5, 9, 14, 3], [7, 7, 21], [30, 2, 11, 19, 4]]


def _seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def _commands(llm, prompts, params):
    """``llm.generate`` with every step command its one rank ran recorded (the real channel
    runs each)."""
    channel, sent = llm.model.channel, []
    run = channel.run
    channel.run = lambda cmd: (sent.append(cmd), run(cmd))[1]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        del channel.run
    return [list(o.outputs[0].token_ids) for o in outs], sent


def test_a_seeded_request_draws_alike_as_its_batch_mates_finish(llm):
    """The short request finishes first: the command after drops its row, the others repeat
    (no explicit decode rows); each seeded output equals that request run alone (a row kept
    in the wrong place, or another's draw, would differ; the output index a repeat derives
    is pinned on the mirror below)."""
    params = [_seeded(14, 1), _seeded(4, 2), _seeded(14, 3)]
    together, sent = _commands(llm, PROMPTS, params)
    alone = [_commands(llm, [p], [sp])[0][0] for p, sp in zip(PROMPTS, params)]
    assert together == alone
    repeats = [c for c in sent if c.repeat]
    assert len(repeats) >= 10 and all(not len(c.decode) for c in repeats[-5:])
    assert any(len(c.dropped) == 1 for c in repeats)  # the short one left, the rest repeated
    quiet = [c for c in repeats if not c.block_updates and not len(c.dropped)]
    plain = StepCommand(step_id=quiet[-1].step_id)  # no per-row bytes: as long as a command
    assert len(P.encode(quiet[-1])) == len(P.encode(plain))  # without rows


def test_a_late_arrival_joins_the_repeat_as_an_explicit_row(llm):
    """A request that arrives while another decodes is added after the kept rows; each
    seeded output equals its run alone."""
    eng, channel, sent = llm.engine, llm.model.channel, []
    run = channel.run
    channel.run = lambda cmd: (sent.append(cmd), run(cmd))[1]
    try:
        first = eng.add_request(None, PROMPTS[0], _seeded(16, 4))
        done = {}
        for _ in range(4):
            done.update((o.request_id, o) for o in eng.step(finished_only=True))
        late = eng.add_request(None, PROMPTS[2], _seeded(8, 5))
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step(finished_only=True))
    finally:
        del channel.run
    got = [list(done[r.request_id].outputs[0].token_ids) for r in (first, late)]
    # the step the late one first decodes: the first one's row kept, the late one's explicit
    assert any(c.repeat and not len(c.dropped) and len(c.decode) == 1 for c in sent)
    alone = [_commands(llm, [p], [sp])[0][0]
             for p, sp in ((PROMPTS[0], _seeded(16, 4)), (PROMPTS[2], _seeded(8, 5)))]
    assert got == alone


# --------------------------------------------------------------------------- every rank


def _mirror() -> EpMirror:
    """Two ranks, blocks of 4: (0, 0) with 2 tokens, (1, 1) with 2, (0, 2) with 1, each in
    one block."""
    m = EpMirror(world_size=2, num_blocks=16, block_size=4, max_slots=4, max_blocks_per_seq=4,
                 vocab_size=50)
    seqs = [(0, 0, 2), (1, 1, 2), (0, 2, 1)]
    setup = StepCommand(
        step_id=0, new_seqs=tuple(NewSeq(r, s, 0, n, -1, RowSampling()) for r, s, n in seqs),
        block_updates=tuple(BlockUpdate(r, s, 0, (5 * r + s,)) for r, s, _ in seqs),
        prefill=tuple(PrefillRow(r, s, 0, tuple(range(1, n + 1)), True, 0, -1)
                      for r, s, n in seqs))
    m.validate(setup)
    m.apply(setup)
    return m


def _run(m: EpMirror, cmd: StepCommand) -> tuple:
    m.validate(cmd)
    m.apply(cmd)
    feed = m.decode_feed
    return (m.decode_keys.tolist(), m.decode_pos.tolist(), m.decode_oidx.tolist(),
            None if feed is None else feed.tolist())


ROWS = (DecodeRow(0, 0, 7, 1), DecodeRow(1, 1, 8, 1), DecodeRow(0, 2, 9, 1))


@pytest.mark.parametrize("wire", [False, True], ids=["object", "frame"])
def test_a_repeat_resolves_to_the_rows_it_stands_for(wire):
    """Step 1 explicit; step 2 repeats all; step 3 drops the middle row and adds none; step 4
    adds a row back after the kept one. Positions advance, output indices rise by one, the
    fed token is the one each rank sampled."""
    ship = (lambda c: P.decode(P.encode(c))) if wire else (lambda c: c)
    m = _mirror()
    assert _run(m, ship(StepCommand(step_id=1, decode=ROWS))) == (
        [0, 5, 2], [2, 2, 1], [1, 1, 1], [7, 8, 9])
    assert _run(m, ship(StepCommand(step_id=2, repeat=True))) == (
        [0, 5, 2], [3, 3, 2], [2, 2, 2], None)
    grow = BlockUpdate(0, 0, 1, (11,))  # (0, 0) reaches position 4: a second block
    assert _run(m, ship(StepCommand(step_id=3, repeat=True, dropped=(1,),
                                    block_updates=(grow,)))) == ([0, 2], [4, 3], [3, 3], None)
    back = DecodeRow(1, 1, 12, 3)  # fed a token id again, after the kept rows
    grow = (BlockUpdate(0, 2, 1, (12,)), BlockUpdate(1, 1, 1, (13,)))
    assert _run(m, ship(StepCommand(step_id=4, repeat=True, decode=(back,),
                                    block_updates=grow))) == (
        [0, 2, 5], [5, 4, 4], [4, 4, 3], [FEED_DEVICE, FEED_DEVICE, 12])


def _steady() -> EpMirror:
    """After two steps: (0, 0) and (1, 1) hold 4 tokens (one full block each)."""
    m = _mirror()
    _run(m, StepCommand(step_id=1, decode=ROWS))
    _run(m, StepCommand(step_id=2, repeat=True))
    return m


@pytest.mark.parametrize("cmd, says, key", [
    (StepCommand(step_id=3, repeat=True, dropped=(3,)), "not ascending", None),
    (StepCommand(step_id=3, repeat=True, dropped=(1, 1)), "not ascending", None),
    (StepCommand(step_id=3, repeat=True, dropped=(2, 0)), "not ascending", None),
    (StepCommand(step_id=3, repeat=True, releases=(Release(1, 1),)),
     "releases or starts", (1, 1)),
    (StepCommand(step_id=3, repeat=True, releases=(Release(1, 1),),
                 new_seqs=(NewSeq(1, 1, 0, 2, -1, RowSampling()),)), "releases or starts",
     (1, 1)),
    (StepCommand(step_id=3, repeat=True, decode=(DecodeRow(1, 1, 4, 2),),
                 block_updates=(BlockUpdate(1, 1, 1, (9,)),)), "appears twice",
     None),
], ids=["out-of-range", "twice", "descending", "released", "restarted", "duplicated"])
def test_a_malformed_repeat_is_refused_and_changes_nothing(cmd, says, key):
    m = _steady()
    before = (m.rows_keys.tolist(), m.rows_oidx.tolist(), m.seq_len.copy())
    for c in (cmd, P.decode(P.encode(cmd))):
        m.next_step = 3
        with pytest.raises(EpCommandFailed, match=says) as err:
            m.validate(c)
        assert err.value.bad_rows == (() if key is None else (key,))
    assert (m.rows_keys.tolist(), m.rows_oidx.tolist()) == before[:2]
    assert np.array_equal(m.seq_len, before[2])


def test_a_kept_row_without_room_for_its_token_is_refused_naming_it():
    """(0, 0) fills its one block at position 3 and would write position 4 with no block."""
    m = _steady()
    with pytest.raises(EpCommandFailed, match="no KV block for position 4") as err:
        m.validate(StepCommand(step_id=3, repeat=True))
    assert err.value.bad_rows == ((0, 0),)


@pytest.mark.parametrize("field, value", [(-2, b""), (2, b""), (1, b"\x00\x00\x00")],
                         ids=["negative", "two", "ragged"])
def test_a_malformed_repeat_field_is_a_protocol_error(field, value):
    import msgpack

    frame = msgpack.unpackb(P.encode(StepCommand(step_id=1)), raw=False)
    frame[-2:] = [field, value]
    with pytest.raises(ProtocolError):
        P.decode(msgpack.packb(frame, use_bin_type=True))
