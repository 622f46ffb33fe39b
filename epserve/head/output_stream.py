"""Request outputs as deltas on the wire: what the head sends to a client once per step, and
the client's side that turns them back into vLLM's cumulative ``RequestOutput``.

Owns the delta record and its codec. The head builds, for every request a step changed, one
record holding only what each choice gained since the last record (new token ids, new text,
the new tokens' raw logprobs, the finish reason), so a message's size grows with the step, not
with the length of the outputs; many records travel as one msgpack frame. Invariants: a
sequence's progress cursor (``Sequence.sent_tokens`` / ``sent_chars``) is written here only;
the text sent never ends in something that could still become a stop string, and never shrinks
(held-back text is sent once it is safe, or dropped when a stop string cuts it); applying every
record of a request, in order, gives exactly the engine's final output. Logprob dicts (with
decoded token strings) are built on the client, from raw ids, by the client's tokenizer.
Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import msgpack

from epserve.head.outputs import CompletionOutput, RequestOutput, make_logprobs_dict
from epserve.head.sequence import Request

WIRE_VERSION = 2

#: A record: [request_id, finished, error, num_cached_tokens, prompt_logprobs | None, choices]
#: with choices [[index, new_ids, new_text, new_logprobs | None, finish_reason, stop_reason]];
#: a raw logprob entry (a sampled or a prompt token) is
#: [token_id, logprob, [[alt_id, alt_logprob], ...], rank | None] (rank: vLLM's, of the token).
Record = list


def _raw(tok: Any) -> list:
    return [tok.token_id, float(tok.logprob), [[int(t), float(lp)] for t, lp in tok.top],
            None if tok.rank is None else int(tok.rank)]


def delta_record(req: Request) -> Record | None:
    """What ``req`` gained since its last record (None: nothing new); advances its cursors."""
    choices = []
    for seq in req.seqs:
        safe = seq.text if seq.finished else seq.text[:seq.stops.safe_stream_len(seq.text)]
        new_ids = seq.output_ids[seq.sent_tokens:]
        new_text = safe[seq.sent_chars:] if len(safe) > seq.sent_chars else ""
        ended = seq.finished and not seq.sent_finish
        if not (new_ids or new_text or ended):
            continue
        lps = None
        if req.params.logprobs is not None:
            lps = [_raw(t) for t in seq.sampled[seq.sent_tokens:]]
        choices.append([seq.index, list(new_ids), new_text, lps,
                        seq.finish_reason if seq.finished else None,
                        seq.stop_reason if seq.finished else None])
        seq.sent_tokens = len(seq.output_ids)
        seq.sent_chars = max(seq.sent_chars, len(safe))
        seq.sent_finish = seq.finished
    plps = None
    if req.prompt_logprobs is not None and not req.sent_prompt_logprobs:
        plps = [_raw(e) for e in req.prompt_logprobs]
        req.sent_prompt_logprobs = True
    if not choices and plps is None and not (req.finished and not req.sent_finished):
        return None
    req.sent_finished = req.finished
    return [req.request_id, req.finished, req.error, req.num_cached_tokens, plps, choices]


def encode_records(records: Sequence[Record]) -> bytes:
    return msgpack.packb([WIRE_VERSION, list(records)], use_bin_type=True)


def decode_records(frame: bytes) -> list[Record]:
    """The records of a frame this head sent (a trusted peer: malformed is a bug, ValueError)."""
    version, records = msgpack.unpackb(frame, raw=False)
    if version != WIRE_VERSION:
        raise ValueError(f"output frame version {version}, this client speaks {WIRE_VERSION}")
    return records


@dataclass
class Submission:
    """One request as a client submits it to the head (plain values only)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    prompt: str | None = None

    def to_wire(self) -> list:
        return [self.request_id, self.prompt_token_ids, self.params, self.prompt]

    @classmethod
    def from_wire(cls, v: Sequence[Any]) -> "Submission":
        rid, ids, params, prompt = v
        return cls(str(rid), list(ids), dict(params), prompt)


class OutputAccumulator:
    """A client's cumulative ``RequestOutput`` of one request, grown by its records.

    ``decode``: token id -> its text, for the logprob dicts (None leaves ``decoded_token``
    unset). ``n``: choices; ``want_logprobs``: keep ``logprobs``/``cumulative_logprob``."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], n: int,
                 want_logprobs: bool, decode: Callable[[int], str] | None = None):
        self.decode = decode
        self.want_logprobs = want_logprobs
        self.output = RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
            outputs=[CompletionOutput(index=i, logprobs=[] if want_logprobs else None,
                                      cumulative_logprob=0.0 if want_logprobs else None)
                     for i in range(n)])

    def apply(self, record: Record) -> RequestOutput:
        _, finished, error, cached, plps, choices = record
        out = self.output
        out.num_cached_tokens = cached
        if plps is not None:
            out.prompt_logprobs = [None] + [
                make_logprobs_dict(t, lp, [tuple(a) for a in top], self.decode, rank)
                for t, lp, top, rank in plps]
        for index, ids, text, lps, reason, stop_reason in choices:
            c = out.outputs[index]
            c.token_ids.extend(ids)
            c.text += text
            if lps is not None and self.want_logprobs:
                c.logprobs.extend(make_logprobs_dict(t, lp, [tuple(a) for a in top], self.decode,
                                                     rank) for t, lp, top, rank in lps)
                c.cumulative_logprob += sum(e[1] for e in lps)
            if reason is not None:
                c.finish_reason, c.stop_reason = reason, stop_reason
        if error is not None:
            out.error = error
            for c in out.outputs:
                c.finish_reason = c.finish_reason or "error"
        out.finished = bool(finished)
        return out


def snapshot(out: RequestOutput) -> RequestOutput:
    """A copy of ``out`` that later records do not change (for callers that keep outputs)."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(c, token_ids=list(c.token_ids),
                            logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in out.outputs])


def records_of(requests: Iterable[Request]) -> list[Record]:
    """The delta record of every request that has something new."""
    return [r for r in (delta_record(req) for req in requests) if r is not None]
