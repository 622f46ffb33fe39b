"""Gated-DeltaNet hybrids under expert parallelism, as a user of LLM(ep_size=N) sees them: each
sequence's recurrent state lives on the rank that runs its attention (nothing is mirrored), the
routed experts are sharded, and the outputs over N ranks equal one rank's, with chunked prefill
across the linear-attention layers, preemption and sequences spread over the ranks."""

from __future__ import annotations

import random

import pytest

from epserve import LLM, SamplingParams
from tiny_ckpt import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
STRESS = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24,
              long_prefill_token_threshold=8)


@pytest.mark.parametrize("arch, ep_size", [("qwen3_next", 3), ("qwen3_5_moe", 2)])
def test_hybrid_over_ep_matches_one_rank(ray_cluster, tmp_path, arch, ep_size):
    ckpt = make_tiny_checkpoint(arch, tmp_path / arch, num_experts=6)
    rng = random.Random(2)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]}
               for n in (3, 9, 17, 4, 28, 6, 11, 22)]
    one = LLM(model=str(ckpt), **STRESS)
    want = [o.outputs[0] for o in one.generate(prompts, GREEDY)]
    assert one.engine.scheduler.num_preemptions > 0
    ep = LLM(model=str(ckpt), ep_size=ep_size, **STRESS)
    try:
        got = [o.outputs[0] for o in ep.generate(prompts, GREEDY)]
    finally:
        ep.close()
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        assert [d[t].logprob for d, t in zip(g.logprobs, g.token_ids)] == pytest.approx(
            [d[t].logprob for d, t in zip(w.logprobs, w.token_ids)], abs=1e-5)
