"""One request can never fail another: random (often hostile) sampling parameters sent beside
innocent requests, at ep_size 1 and 2.

For each drawn request: either ``LLM.generate`` refuses it up front with a ``ValueError`` naming
the field (nothing runs), or it is served without error at both rank counts, and the innocent
requests of the same steps come out exactly as they do alone.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
INNOCENT = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [40, 41, 42]}]
FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens",
          "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs",
          "skip_special_tokens", "include_stop_str_in_output", "prompt")


@pytest.fixture(scope="module")
def engines(ray_cluster, qwen3_ckpt):
    ep1 = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=96)
    ep2 = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=96, ep_size=2)
    want = [o.outputs[0].token_ids for o in ep1.generate(INNOCENT, GREEDY)]
    assert [o.outputs[0].token_ids for o in ep2.generate(INNOCENT, GREEDY)] == want
    yield ep1, ep2, want
    ep2.close()


def _vocab(llm: LLM) -> int:
    return llm.engine.cfg.vocab_size


reals = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 3),
                  st.sampled_from([0.0, 1.0, 1e-9, 1e-6, 0.5, 2.0, -0.0, 1e308]))


@st.composite
def hostile(draw, vocab: int) -> tuple[dict, list[int]]:
    ids = st.integers(-3, vocab + 3)
    kw = draw(st.fixed_dictionaries({}, optional={
        "n": st.integers(-1, 3),
        "temperature": reals,
        "top_p": reals,
        "top_k": st.one_of(st.integers(-3, 8), st.sampled_from(
            [vocab - 1, vocab, vocab + 1, 2**31, 2**63, 2**70])),
        "min_p": reals,
        "seed": st.one_of(st.none(), st.integers(-2**70, 2**70)),
        "max_tokens": st.one_of(st.none(), st.integers(-1, 12)),
        "min_tokens": st.integers(-1, 14),
        "stop": st.one_of(st.none(), st.text(max_size=3),
                          st.lists(st.text(max_size=4), max_size=5)),
        "stop_token_ids": st.one_of(st.none(), st.lists(ids, max_size=4)),
        "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(-2, 24)),
        "prompt_logprobs": st.one_of(st.none(), st.integers(-2, 24)),
        "include_stop_str_in_output": st.booleans(),
    }))
    prompt = draw(st.lists(ids, min_size=0, max_size=30))
    return kw, prompt


def _run(llm: LLM, prompt: list[int], params: SamplingParams):
    return llm.generate(INNOCENT + [{"prompt_token_ids": prompt}], [GREEDY, GREEDY, params])


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_random_sampling_never_fails_an_innocent_request(engines, data):
    ep1, ep2, want = engines
    kw, prompt = data.draw(hostile(_vocab(ep1)))
    try:
        params = SamplingParams(**kw)
    except ValueError as exc:
        assert str(exc).startswith("SamplingParams.") and any(f in str(exc) for f in FIELDS)
        return
    refused = []
    for llm in (ep1, ep2):
        try:
            outs = _run(llm, prompt, params)
        except ValueError as exc:  # refused up front, naming the field
            msg = str(exc)
            assert msg.startswith("prompts[2]:") and any(f in msg for f in FIELDS), msg
            refused.append(msg)
            continue
        assert [o.error for o in outs] == [None, None, None], [o.error for o in outs]
        assert [o.outputs[0].token_ids for o in outs[:2]] == want
        assert len(outs[2].outputs) == params.n
    assert len(refused) in (0, 2), f"refused at one rank count only: {refused}"
