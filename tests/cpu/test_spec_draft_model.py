"""Speculative decoding with a draft model, as a user of the offline API sees it: the output is
the output without speculation whatever the draft is; the target used as its own draft accepts
every drafted token (k + 1 tokens per verify row); the draft's KV is given back when its
sequences end; a draft that cannot serve the target is refused at start, naming the key."""

from __future__ import annotations

import dataclasses
import random

import pytest

from epserve import LLM, SamplingParams
from tiny_ckpt import make_tiny_checkpoint


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """A different, smaller model with the same vocabulary."""
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("draft"), seed=5,
                                num_hidden_layers=1)


def _reqs() -> list[dict]:
    rng = random.Random(4)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]}
            for n in (3, 7, 12, 5, 21, 30, 9)]


def _llm(path, draft=None, k: int = 3, **kw) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": str(draft),
                                       "num_speculative_tokens": k}
    return LLM(model=str(path), dtype="float32", seed=0, max_model_len=128,
               speculative_config=spec, **kw)


def _run(path, draft=None, k: int = 3, **kw):
    llm = _llm(path, draft, k, **kw)
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)
    steps = 0
    step = llm.engine.step

    def counted(*a, **kwargs):
        nonlocal steps
        steps += 1
        return step(*a, **kwargs)

    llm.engine.step = counted
    outs = llm.generate(_reqs(), greedy)
    st = llm.engine.stats.spec  # temperature 0 alone
    greedy_stats = dataclasses.replace(st, accepted_per_pos=list(st.accepted_per_pos or ()))
    greedy_steps = steps
    outs += llm.generate(_reqs(), seeded)
    return llm, outs, greedy_steps, greedy_stats


def _same(want, got) -> None:
    for w, g in zip(want, got, strict=True):
        assert w.outputs[0].token_ids == g.outputs[0].token_ids
        if w.outputs[0].logprobs is not None:
            for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert {t: p.logprob for t, p in a.items()} == pytest.approx(
                    {t: p.logprob for t, p in b.items()}, abs=1e-5)


CASES = {"plain": {}, "chunked, preempting": {"max_num_batched_tokens": 16, "block_size": 4,
                                              "num_kv_blocks": 40}}


@pytest.fixture(scope="module")
def plain_run():
    """``_run`` without speculation, once per checkpoint and engine options: the tests below
    compare with the same run."""
    runs: dict = {}

    def get(path, **kw):
        key = (str(path), tuple(sorted(kw.items())))
        if key not in runs:
            runs[key] = _run(path, **kw)
        return runs[key]

    return get


@pytest.mark.parametrize("arch, case", [("qwen3_ckpt", "plain"), ("mixtral_ckpt", "plain"),
                                        ("qwen3_ckpt", "chunked, preempting")])
def test_the_target_as_its_own_draft_accepts_every_draft(request, plain_run, arch, case):
    tiny_ckpt = request.getfixturevalue(arch)
    _, want, plain_steps, _ = plain_run(tiny_ckpt, **CASES[case])
    llm, got, steps, st = _run(tiny_ckpt, draft=tiny_ckpt, k=3, **CASES[case])
    _same(want, got)
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens
    if case == "plain":  # every row drafts k: k + 1 tokens per verify row
        assert st.accepted_per_pos == [st.num_drafts] * 3
    assert steps < plain_steps
    draft = llm.engine.scheduler.proposer.model  # every draft sequence given back
    assert draft.num_free_blocks() == draft.num_total_blocks()
    if case != "plain":
        assert llm.engine.scheduler.num_preemptions > 0


def test_any_draft_leaves_the_output_unchanged(qwen3_ckpt, other_draft, plain_run):
    base, want, _, _ = plain_run(qwen3_ckpt)
    llm, got, _, _ = _run(qwen3_ckpt, draft=other_draft, k=4)
    _same(want, got)
    st = llm.engine.stats.spec
    assert st.num_drafts > 0 and st.num_accepted_tokens < st.num_draft_tokens
    own = _llm(qwen3_ckpt, draft=qwen3_ckpt, k=4)  # runs of 5 accepted tokens:
    stop = want[-1].outputs[0].token_ids[6]  # max_tokens and stops land inside them
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (2, 7)] + [
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop])]
    reqs = [r for _ in params for r in _reqs()]  # one batch: each prompt under each ending
    sps = [sp for sp in params for _ in _reqs()]
    _same(base.generate(reqs, sps), own.generate(reqs, sps))


def test_a_draft_that_cannot_serve_the_target_is_refused(qwen3_ckpt, tmp_path):
    wrong_vocab = make_tiny_checkpoint("qwen3_moe", tmp_path / "v", vocab_size=400)
    for spec, says in [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": str(tmp_path / "no")},
         "speculative_config.model: .*no such folder"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": str(wrong_vocab)},
         "400 tokens, the target's 320"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": str(qwen3_ckpt),
          "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ]:
        with pytest.raises(ValueError, match=says):
            LLM(model=str(qwen3_ckpt), dtype="float32", speculative_config=spec)
