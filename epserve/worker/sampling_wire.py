"""A row's ``RowSampling`` as it travels in the step command (new sequences, sampling updates).

Owns the sampling part of those records and its words: the scalar fields as one fixed-width
record, and one int32 run per row holding the banned ids, then a ``logit_bias``'s ids, then its
biases as float64 (two words each, so the ranks read exactly the float the leader sent).
Invariants: a row without a bias adds one zero count to its record and nothing else; a decoded
table whose counts its words cannot hold is a ``ProtocolError`` before any row is built; values
are judged by ``models.sampling_rules`` on every rank (``worker.ep_mirror``), not here.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from epserve.models.traits import RowSampling
from epserve.worker.wire import F64, I64, U64, Ints, ProtocolError, Table

SAMPLING_FIELDS = [("temperature", F64), ("top_p", F64), ("top_k", I64), ("min_p", F64),
                   ("seed", U64), ("logprobs", I64), ("presence", F64), ("frequency", F64),
                   ("repetition", F64), ("n_bias", I64)]
SAMPLING_KINDS = "ffifiifffi"


def sampling_fields(s: RowSampling) -> tuple:
    """A row's ``RowSampling`` as wire fields (``logprobs`` None travels as -1; its
    ``banned_token_ids`` and ``logit_bias`` beside, as words: ``sampling_words``)."""
    return (s.temperature, s.top_p, s.top_k, s.min_p, s.seed,
            -1 if s.logprobs is None else s.logprobs, s.presence_penalty, s.frequency_penalty,
            s.repetition_penalty, len(s.logit_bias))


def sampling_words(s: RowSampling) -> Sequence[int]:
    """The row's int32 words: its banned ids, then (with a ``logit_bias`` of k pairs) the k
    ids and the k biases as float64, two words each (exact: the ranks read the same float)."""
    if not s.logit_bias:
        return s.banned_token_ids
    try:
        ids, biases = zip(*s.logit_bias)
        bits = np.array(biases, dtype="<f8").view("<i4").tolist()
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"logit_bias: {exc}") from None
    return [*s.banned_token_ids, *ids, *bits]


def row_sampling(v: tuple, words: Ints) -> RowSampling:
    """``banned`` stays ``Ints`` (equal to the tuple the leader sent); the bias pairs are
    built as the leader's tuple (``check_bias_counts`` ran on the records first)."""
    k = v[9]
    if not k:
        return RowSampling(v[0], v[1], v[2], v[3], v[4], words, None if v[5] == -1 else v[5],
                           (), v[6], v[7], v[8])
    n = len(words)
    ids = words.array[n - 3 * k:n - 2 * k].tolist()
    biases = np.ascontiguousarray(words.array[n - 2 * k:]).view("<f8").tolist()
    return RowSampling(v[0], v[1], v[2], v[3], v[4], words[:n - 3 * k],
                       None if v[5] == -1 else v[5], tuple(zip(ids, biases)), v[6], v[7], v[8])


def check_bias_counts(table: Table) -> Table:
    """A decoded sampling table whose every row's words hold its ``n_bias`` pairs."""
    if len(table):
        k, n = table.recs["n_bias"], table.recs["n"]
        if k.min() < 0 or (k > n // 3).any():
            raise ProtocolError(f"{table.spec.name}: a logit_bias count its words do not hold")
    return table
