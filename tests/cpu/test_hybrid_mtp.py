"""Speculative decoding with the checkpoint's own MTP head (``speculative_config={"method":
"mtp", "num_speculative_tokens": k}``, vLLM's shape), as a user of the offline API sees it: the
output is the output without speculation (greedy tokens and logprobs, seeded draws), through
chunked prefill and preemption; a head trained to draft the target's picks gets most drafts
accepted (fewer steps than tokens), a random head almost none (and still changes nothing); a
checkpoint without an MTP head is refused at start, naming the method."""

from __future__ import annotations

import random

import pytest

from epserve import LLM, SamplingParams
from tiny_ckpt import SUCC_HI, SUCC_LO, make_tiny_checkpoint


def _mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    counting = [list(range(a, a + n)) for a, n in ((20, 5), (150, 9), (290, 6))]
    return counting + [[rng.randrange(SUCC_LO, SUCC_HI) for _ in range(n)] for n in (3, 11)]


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", seed=0, max_model_len=128, **kw)


def _same(want, got, atol: float = 1e-4) -> None:
    for w, g in zip(want, got, strict=True):
        a, b = w.outputs[0], g.outputs[0]
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs or (), b.logprobs or (), strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=atol)


GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
SEEDED = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("k, case", [(2, {}), (3, {"max_num_batched_tokens": 8,
                                                   "block_size": 4, "num_kv_blocks": 8})])
def test_a_trained_head_drafts_what_the_target_picks_and_changes_nothing(trained_mtp_ckpt, k,
                                                                         case):
    reqs = [{"prompt_token_ids": p} for p in _prompts()]
    base, spec = _llm(trained_mtp_ckpt, **case), _llm(trained_mtp_ckpt,
                                                      speculative_config=_mtp(k), **case)
    assert "draft" in spec.model.capabilities()
    for sp in (GREEDY, SEEDED):
        _same(base.generate(reqs, sp), spec.generate(reqs, sp))
    st = spec.engine.stats.spec
    assert st.num_drafts > 0 and st.num_accepted_tokens >= 0.7 * st.num_draft_tokens, st
    if case:
        assert spec.engine.scheduler.num_preemptions > 0
    # one counting request alone: fewer steps than tokens
    before = spec.stats()["steps"]
    out = spec.generate([{"prompt_token_ids": list(range(40, 48))}], GREEDY)[0].outputs[0]
    assert out.token_ids == list(range(48, 68))
    assert spec.stats()["steps"] - before <= len(out.token_ids) // 2


def test_drafting_up_to_max_model_len(trained_mtp_ckpt):
    """Near ``max_model_len`` the chained drafts stop where no KV block may be had; the
    request runs to the limit as without speculation."""
    reqs = [{"prompt_token_ids": list(range(30, 38))}]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = dict(model=str(trained_mtp_ckpt), dtype="float32", max_model_len=24, block_size=4)
    want = LLM(**kw).generate(reqs, sp)[0].outputs[0]
    got = LLM(**kw, speculative_config=_mtp(3)).generate(reqs, sp)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 24 - 8
    assert got.finish_reason == want.finish_reason == "length"


def test_a_random_head_changes_nothing(tmp_path):
    ckpt = make_tiny_checkpoint("qwen3_next", tmp_path / "next", mtp_layers=1)
    reqs = [{"prompt_token_ids": p} for p in _prompts()]
    want = _llm(ckpt).generate(reqs, GREEDY)
    spec = _llm(ckpt, speculative_config=_mtp(2))
    _same(want, spec.generate(reqs, GREEDY))
    st = spec.engine.stats.spec
    assert st.num_drafts > 0 and st.num_draft_tokens > st.num_accepted_tokens


def test_a_checkpoint_without_an_mtp_head_is_refused(tmp_path):
    ckpt = make_tiny_checkpoint("qwen3_next", tmp_path / "plain")
    with pytest.raises(ValueError, match="speculative_config.method='mtp'.*no MTP head"):
        _llm(ckpt, speculative_config=_mtp(2))


def test_a_decode_lookahead_asked_for_beside_an_mtp_head_is_refused(trained_mtp_ckpt):
    """A forward queued ahead would overwrite the hidden states the MTP head reads: asked for
    explicitly, the combination is refused at start, naming both (by default the lookahead is
    simply off with an MTP head)."""
    with pytest.raises(ValueError, match="decode_lookahead.*'mtp'"):
        _llm(trained_mtp_ckpt, speculative_config=_mtp(2), decode_lookahead=True)
