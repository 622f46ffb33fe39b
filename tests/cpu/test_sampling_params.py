"""SamplingParams: defaults, validation (the message names the field), stop normalisation."""

import dataclasses
import math

import pytest

from epserve.head.sampling_params import MAX_LOGPROBS, SamplingParams
from epserve.models.traits import RowSampling


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == () and p.stop_token_ids == ()
    assert p.ignore_eos is False and p.skip_special_tokens is True
    assert p.include_stop_str_in_output is False
    assert p.logprobs is None and p.prompt_logprobs is None


def test_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("stop, want", [
    (None, ()), ("x", ("x",)), (["a", "bc"], ("a", "bc")), (("a", "a", "b"), ("a", "b")),
])
def test_stop_normalised_to_tuple(stop, want):
    assert SamplingParams(stop=stop).stop == want


def test_stop_token_ids_normalised():
    assert SamplingParams(stop_token_ids=[5, 3, 5]).stop_token_ids == (5, 3)
    assert SamplingParams(stop_token_ids={7, 2}).stop_token_ids == (2, 7)


def test_max_tokens_none_and_valid_edges():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None
    SamplingParams(temperature=0, top_p=1e-9, min_p=1.0, top_k=-1, logprobs=MAX_LOGPROBS,
                   prompt_logprobs=0, min_tokens=16, max_tokens=16, seed=-3)


BAD = [
    ("n", 0), ("n", True), ("n", 1.0), ("n", None),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
    ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan), ("top_p", False),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.01), ("min_p", math.nan),
    ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 17), ("min_tokens", None),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [True]), ("stop_token_ids", [1.0]), ("stop_token_ids", 3),
    ("ignore_eos", 1), ("skip_special_tokens", None), ("include_stop_str_in_output", "yes"),
    ("logprobs", -1), ("logprobs", True), ("logprobs", 1.0),  # the bound: the engine's
    ("prompt_logprobs", -1), ("prompt_logprobs", False),
    ("structured_outputs", 5), ("structured_outputs", "json"),
    ("logit_bias", [(1, 2.0)]), ("logit_bias", {"1": 2.0}), ("logit_bias", {-1: 0.0}),
    ("logit_bias", {1: math.nan}), ("logit_bias", {True: 1.0}), ("logit_bias", {1: "2"}),
    ("presence_penalty", 2.5), ("presence_penalty", math.nan), ("presence_penalty", "1"),
    ("frequency_penalty", -2.01), ("frequency_penalty", True),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
]


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_invalid_value_names_field_and_value(field, value):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    msg = str(e.value)
    assert field in msg
    assert repr(value) in msg or str(value) in msg


def test_every_field_has_a_bad_case():
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert names == {f for f, _ in BAD}


def test_replace_revalidates():
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(SamplingParams(), top_p=2.0)


def test_to_row_sampling():
    p = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, logprobs=3)
    r = p.to_row_sampling(seed=42, banned=(2, 9))
    assert r == RowSampling(temperature=0.7, top_p=0.9, top_k=0, min_p=0.05, seed=42,
                            banned_token_ids=(2, 9), logprobs=3)
    g = SamplingParams(temperature=1e-7).to_row_sampling(seed=1, banned=())
    assert g.temperature == 0.0 and g.logprobs is None
    assert SamplingParams(temperature=0).is_greedy and not p.is_greedy


# The request-facing output types (epserve.head.outputs) travel with SamplingParams.
def test_outputs_shapes():
    from epserve.head.outputs import CompletionOutput, Logprob, RequestOutput, make_logprobs_dict

    d = make_logprobs_dict(9, -3.0, [(4, -0.1), (9, -3.0)], decode=lambda t: f"<{t}>")
    assert d == {4: Logprob(-0.1, 1, "<4>"), 9: Logprob(-3.0, 2, "<9>")}
    assert make_logprobs_dict(7, -5.0, [(4, -0.1)])[7] == Logprob(-5.0, None, None)
    c = CompletionOutput(index=0, text="hi", token_ids=[1, 2], logprobs=[d, d])
    assert not c.finished()
    c.finish_reason, c.stop_reason = "stop", "\n"
    assert c.finished()
    r = RequestOutput("r1", "p", [5], prompt_logprobs=[None], outputs=[c], finished=True)
    assert "<2 positions>" in repr(r) and "'r1'" in repr(r) and r.error is None
