"""Gated-DeltaNet hybrids under expert parallelism, as a user of LLM(ep_size=N) sees them: each
sequence's recurrent state lives on the rank that runs its attention (nothing is mirrored), the
routed experts are sharded, and the outputs over N ranks equal one rank's, with chunked prefill
across the linear-attention layers, preemption and sequences spread over the ranks; with
n-gram speculation too."""

from __future__ import annotations

import random
import time

import pytest

from epserve import LLM, SamplingParams
from rewind_faults import drive, rewinding_to
from spec_ckpt import counting_prompts, make_successor_checkpoint
from tiny_ckpt import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
STRESS = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24,
              long_prefill_token_threshold=8)


@pytest.mark.parametrize("arch, ep_size", [("qwen3_next", 3), ("qwen3_5_moe", 2),
                                           ("qwen3_next", 2), ("qwen3_5_moe", 3)])
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
    _assert_same(got, want)


def _assert_same(got, want) -> None:
    """Token-identical, each token's logprob within 1e-5."""
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        assert [d[t].logprob for d, t in zip(g.logprobs, g.token_ids)] == pytest.approx(
            [d[t].logprob for d, t in zip(w.logprobs, w.token_ids)], abs=1e-5)


def _settled(llm: LLM, generated: int) -> dict:
    """The head's counters once they count ``generated`` tokens (published just after the
    outputs are handed over)."""
    deadline = time.monotonic() + 10
    while (stats := llm.stats())["generation_tokens"] < generated:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def _spec_over_ep(ckpt, spec: dict) -> dict:
    """The counting prompts over two ranks with ``spec``: tokens and logprobs equal one rank's
    without speculation; the head's speculation counters."""
    prompts = [{"prompt_token_ids": p} for p in counting_prompts()]
    want = [o.outputs[0] for o in LLM(model=str(ckpt), **STRESS).generate(prompts, GREEDY)]
    ep = LLM(model=str(ckpt), ep_size=2, speculative_config=spec, **STRESS)
    try:
        got = [o.outputs[0] for o in ep.generate(prompts, GREEDY)]
        stats = _settled(ep, GREEDY.max_tokens * len(prompts))["spec_decode"]
    finally:
        ep.close()
    _assert_same(got, want)
    return stats


def test_speculation_on_a_hybrid_over_ep_matches_one_rank(ray_cluster, tmp_path):
    """n-gram drafts verified on the ranks that hold each sequence's states (each folds the
    accepted prefix in by its own verdict), drafts accepted and rejected."""
    ckpt = make_successor_checkpoint("qwen3_next", tmp_path / "succ", num_experts=6)
    spec = _spec_over_ep(ckpt, NGRAM)
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec


def test_mtp_drafts_over_ep_match_one_rank(ray_cluster, trained_mtp_ckpt):
    """The MTP head drafts on each sequence's rank after every step; its MoE exchanges tokens
    with the other ranks, which run every draft pass too; most drafts are accepted."""
    spec = _spec_over_ep(trained_mtp_ckpt, {"method": "mtp", "num_speculative_tokens": 2})
    assert spec["num_accepted_tokens"] >= 0.5 * spec["num_draft_tokens"] > 0, spec


def test_a_rewind_outside_the_verify_fails_only_its_request_on_every_rank(ray_cluster, tmp_path):
    """Under EP a command whose rewind would take a sequence's KV somewhere its states are not
    is refused by every rank alike (each worker logs EpCommandFailed and keeps going); only
    that request fails, the others come out as on one rank without speculation."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from epserve.cluster.engine_args import EngineArgs, build_engine
    from epserve.cluster.ep_group import EpGroup, bundle

    ckpt = make_successor_checkpoint("qwen3_next", tmp_path / "succ", num_experts=6)
    prompts = counting_prompts()
    want = [o.outputs[0].token_ids for o in LLM(model=str(ckpt), **STRESS).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY)]
    args = EngineArgs(model=str(ckpt), ep_size=2, speculative_config=NGRAM, **STRESS).resolved()
    pg = placement_group([bundle("cpu")] * 2, strategy="STRICT_PACK")
    ray_cluster.get(pg.ready(), timeout=60)
    group = EpGroup(args, pg)
    group.join()
    fired: dict = {}
    try:
        engine = build_engine(args, runner=group.leader)[0]
        before = [len(f) for f in ray_cluster.get([w.failures.remote() for w in group.workers])]
        ids, owners, final = drive(engine, group.leader, prompts, GREEDY,
                                   rewinding_to(lambda n, a, b: a, fired), fired)
        after = ray_cluster.get([w.failures.remote() for w in group.workers])
    finally:
        group.shutdown(graceful=True)
        remove_placement_group(pg)
    bad = owners[fired["key"]]
    for rid, w in zip(ids, want):
        if rid == bad:
            assert "its recurrent state can only go back inside the verify" in final[rid].error
        else:
            assert final[rid].error is None and final[rid].outputs[0].token_ids == w
    assert [len(f) - b for f, b in zip(after, before)] == [1] * len(after), after
    assert all("can only go back inside the verify" in f[-1]["reason"] for f in after)
