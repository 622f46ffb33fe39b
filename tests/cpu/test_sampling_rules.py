"""The head's edge and every EP rank judge a row's sampling by one rule (models.sampling_rules):
whatever ``SamplingParams`` (and the engine's stop-id check) accepts, the ranks' validator
accepts too, so no accepted request can make a step command invalid."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epserve.head.limits import RequestLimits
from epserve.head.sampling_params import SamplingParams
from epserve.models.sampling_rules import token_ids_problem
from epserve.models.traits import EpCommandFailed
from epserve.worker.ep_mirror import EpMirror, _Failer

VOCAB = 1000
reals = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
                  st.sampled_from([0.0, 1.0, 1e-9, 0.5, 2.0, 1e308]))


def _mirror() -> EpMirror:
    return EpMirror(world_size=2, num_blocks=8, block_size=4, max_slots=4,
                    max_blocks_per_seq=4, vocab_size=VOCAB)


def _rank_verdict(sp: SamplingParams, seed: int) -> None:
    banned = tuple(sorted(set(sp.stop_token_ids)))  # what min_tokens bans first
    _mirror()._check_sampling(sp.to_row_sampling(seed, banned), _Failer(0),
                              (1, 2))


@settings(max_examples=400, deadline=None)
@given(kw=st.fixed_dictionaries({}, optional={
    "temperature": reals, "top_p": reals, "min_p": reals,
    "top_k": st.one_of(st.integers(-3, 8), st.sampled_from([VOCAB - 1, VOCAB, VOCAB + 1,
                                                            2**31, 2**63, 2**70])),
    "logprobs": st.one_of(st.none(), st.integers(-2, 24)),
    "stop_token_ids": st.lists(st.integers(-3, VOCAB + 3), max_size=4),
    "seed": st.one_of(st.none(), st.integers(-2**70, 2**70))}),
    seed=st.integers(0, 2**63 - 1))
def test_accepted_at_the_edge_means_accepted_by_every_rank(kw, seed):
    try:
        sp = SamplingParams(**kw)
    except ValueError as exc:
        assert str(exc).startswith("SamplingParams.")
        return
    if token_ids_problem(sp.stop_token_ids, VOCAB) is not None:
        return  # the engine refuses these stop ids before queueing (check_request)
    try:
        RequestLimits().check(sp)  # and logprobs over its max_logprobs (20 by default)
    except ValueError:
        return
    _rank_verdict(sp, seed)


def test_top_k_above_the_vocabulary_is_served_as_off():
    for k in (VOCAB, VOCAB + 1, 2**40, 2**70):
        _rank_verdict(SamplingParams(top_k=k), 7)


def test_a_rank_refusal_names_the_sequence_to_blame():
    sp = SamplingParams().to_row_sampling(3, (VOCAB + 5,))
    with pytest.raises(EpCommandFailed) as info:
        _mirror()._check_sampling(sp, _Failer(0), (1, 2))
    assert info.value.bad_rows == ((1, 2),) and "banned_token_ids" in info.value.reason
