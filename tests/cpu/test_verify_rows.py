"""Verify rows and rewinds in the step command, as every rank judges them: a well-formed verify
row (and the rewind after it) passes on the object and on the decoded frame; each malformed
one is refused with ``EpCommandFailed`` naming the sequence whose row it is, and the mirror is
left unchanged (so the next command is judged against the same state)."""

from __future__ import annotations

import numpy as np
import pytest

from epserve.models.traits import EpCommandFailed, RowSampling
from epserve.worker import step_command as P
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import (
    FEED_DEVICE, KIND_DECODE_AHEAD, BlockUpdate, DecodeRow, MaskRow, NewSeq, PrefillRow,
    Rewind, StepCommand, VerifyRow,
)

VOCAB = 70


def _mirror(lookahead: bool = False) -> EpMirror:
    """Two ranks; (0, 0) holds 6 tokens in 2 blocks of 4, (1, 1) holds 2 in 1 block."""
    m = EpMirror(world_size=2, num_blocks=8, block_size=4, max_slots=4, max_blocks_per_seq=4,
                 vocab_size=VOCAB, lookahead=lookahead)
    setup = StepCommand(step_id=0, new_seqs=(NewSeq(0, 0, 0, 6, -1, RowSampling()),
                                             NewSeq(1, 1, 0, 2, -1, RowSampling())),
                        block_updates=(BlockUpdate(0, 0, 0, (1, 2)), BlockUpdate(1, 1, 0, (3,))),
                        prefill=(PrefillRow(0, 0, 0, (1, 2, 3, 4, 5, 6), True, 0, -1),
                                 PrefillRow(1, 1, 0, (1, 2), True, 0, -1)))
    m.validate(setup)
    m.apply(setup)
    return m


def _state(m: EpMirror) -> tuple:
    return m.live.copy(), m.seq_len.copy(), m.nblocks.copy(), dict(m.slots)


def test_a_verify_row_writes_every_position_and_a_rewind_keeps_the_accepted():
    m = _mirror()
    cmd = StepCommand(step_id=1, verify=(VerifyRow(0, 0, FEED_DEVICE, 1, (7,)),),
                      decode=(DecodeRow(1, 1, 9, 1),))
    for c in (cmd, P.decode(P.encode(cmd))):  # as built and as received
        m2 = _mirror()
        m2.validate(c)
        m2.apply(c)
        assert m2.seq_len[0, 0] == 8 and m2.seq_len[1, 1] == 3  # 6 + 2 positions; 2 + 1
    m.validate(cmd)
    m.apply(cmd)
    rewind = StepCommand(step_id=2, rewinds=(Rewind(0, 0, 7, 2),),
                         decode=(DecodeRow(0, 0, 8, 2),))  # the draft refused: next at 7
    m.validate(P.decode(P.encode(rewind)))
    m.apply(rewind)
    assert m.seq_len[0, 0] == 8 and m.nblocks[0, 0] == 2


ROW = VerifyRow(0, 0, 5, 1, (7,))


@pytest.mark.parametrize("cmd, says, key", [
    (StepCommand(step_id=1, verify=(VerifyRow(0, 2, 5, 1, (7,)),)), "unknown sequence", (0, 2)),
    (StepCommand(step_id=1, verify=(ROW,), decode=(DecodeRow(0, 0, 5, 1),)), "appears twice",
     (0, 0)),
    (StepCommand(step_id=1, verify=(ROW, ROW)), "appears twice", (0, 0)),
    (StepCommand(step_id=1, verify=(ROW,), prefill=(PrefillRow(0, 0, 6, (3,), True, 1, -1),)),
     "appears twice", (0, 0)),
    (StepCommand(step_id=1, verify=(VerifyRow(0, 0, 5, 1, ()),)), "0 drafts", (0, 0)),
    (StepCommand(step_id=1, verify=(VerifyRow(0, 0, 5, 1, (7,) * 17),)), "17 drafts", (0, 0)),
    (StepCommand(step_id=1, verify=(VerifyRow(0, 0, 5, -1, (7,)),)), "output index -1", (0, 0)),
    (StepCommand(step_id=1, verify=(VerifyRow(0, 0, 5, 1, (VOCAB,)),)), "outside the vocab",
     (0, 0)),
    (StepCommand(step_id=1, verify=(VerifyRow(0, 0, -5, 1, (7,)),)), "outside the vocab",
     (0, 0)),
    (StepCommand(step_id=1, verify=(VerifyRow(0, 0, 5, 1, (7, 8)),)), "no KV block for "
     "position 8", (0, 0)),
    (StepCommand(step_id=1, verify=(ROW,), masks=(MaskRow(0, 0, np.full(3, -1, np.int32)),)),
     "samples no token", (0, 0)),
    (StepCommand(step_id=1, rewinds=(Rewind(0, 0, 7, 2),)), r"rewind of \(0, 0\) to 7 tokens",
     (0, 0)),
    (StepCommand(step_id=1, rewinds=(Rewind(0, 0, 5, 1),)), "in 1 blocks", (0, 0)),
    (StepCommand(step_id=1, rewinds=(Rewind(0, 0, 5, 3),)), "in 3 blocks", (0, 0)),
    (StepCommand(step_id=1, rewinds=(Rewind(0, 3, 0, 0),)), "unknown sequence", (0, 3)),
    (StepCommand(step_id=1, rewinds=(Rewind(0, 0, 4, 1),),
                 verify=(VerifyRow(0, 0, 5, 1, (7, 8, 9, 10)),)), "no KV block for position 8",
     (0, 0)),
])
def test_a_malformed_verify_row_or_rewind_is_refused_naming_its_sequence(cmd, says, key):
    frame = P.encode(cmd)
    if any(len(v.drafts) > P.MAX_DRAFT_TOKENS for v in cmd.verify):  # no correct leader's
        with pytest.raises(P.ProtocolError, match="verify: an entry count"):  # frame: the
            P.decode(frame)  # receiver refuses it before building a row
        received = ()
    else:
        received = (P.decode(frame),)
    for c in (cmd, *received):
        m = _mirror()
        before = _state(m)
        with pytest.raises(EpCommandFailed, match=says) as exc:
            m.validate(c)
        assert exc.value.bad_rows == (key,)
        after = _state(m)
        assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                   for a, b in zip(before, after))


def test_a_decode_ahead_step_with_verify_rows_is_refused():
    m = _mirror(lookahead=True)
    with pytest.raises(EpCommandFailed, match="decode-ahead step with verify rows"):
        m.validate(StepCommand(step_id=1, kind=KIND_DECODE_AHEAD, verify=(ROW,)))
