"""What a rank sends back after a step: its sampled tokens and new prompt logprobs (msgpack).

Invariants: nothing is pickled; the leader decodes with the same strict types as commands
(anything malformed is a ``ProtocolError``); entries are keyed by slot, rows in command order.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from epserve.models.traits import PromptTokenLogprob, SampledToken
from epserve.worker.protocol import MAX_FRAME_BYTES, ProtocolError


@dataclass(frozen=True, slots=True)
class RankResult:
    """``sampled``: slot -> token for every sampled row of this rank; ``prompt_logprobs``:
    slot -> the prompt positions scored in this step."""

    step_id: int
    rank: int
    sampled: dict[int, SampledToken]
    prompt_logprobs: dict[int, list[PromptTokenLogprob]]


def _top(top) -> list:
    return [[int(t), float(lp)] for t, lp in top]


def encode_result(res: RankResult) -> bytes:
    body = [res.step_id, res.rank,
            [[slot, t.token_id, float(t.logprob), _top(t.top)] for slot, t in res.sampled.items()],
            [[slot, [[e.token_id, float(e.logprob), _top(e.top)] for e in entries]]
             for slot, entries in res.prompt_logprobs.items()]]
    return msgpack.packb(body, use_bin_type=True)


def _top_from(v) -> tuple[tuple[int, float], ...]:
    return tuple((int(t), float(lp)) for t, lp in v)


def decode_result(frame: bytes) -> RankResult:
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("result frame too large")
    try:
        step_id, rank, sampled, plps = msgpack.unpackb(frame, raw=False, strict_map_key=True)
        return RankResult(
            step_id=int(step_id), rank=int(rank),
            sampled={int(s): SampledToken(int(t), float(lp), _top_from(top))
                     for s, t, lp, top in sampled},
            prompt_logprobs={int(s): [PromptTokenLogprob(int(t), float(lp), _top_from(top))
                                      for t, lp, top in entries] for s, entries in plps})
    except Exception as exc:
        raise ProtocolError(f"malformed result frame: {type(exc).__name__}: {exc}") from None
