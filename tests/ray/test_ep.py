"""Expert parallelism on a local Ray cluster (gloo on loopback), as a user of LLM(ep_size=N) sees it.

Outputs over N ranks equal one rank's and transformers', with sequences spread over ranks,
chunked prefill, prefix-cache hits and preemption in the mix; an invalid step command fails
only its requests on every rank and the next commands are right; a killed rank fails the
in-flight requests within 5 s, health turns unhealthy, the group re-forms and serves again.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from epserve import LLM, SamplingParams
from oracle import hf_greedy
from tiny_ckpt import make_tiny_checkpoint

NEW = 24


def _prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(13)]
    own = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 9, 17, 4, 28, 6, 11, 22)]
    # half the prompts share a 13-token prefix: prefix-cache hits on the second pass
    return [shared + p if i % 2 else p for i, p in enumerate(own)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
# small blocks, a small pool and a small token budget: chunked prefill and preemption happen
STRESS = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24,
              long_prefill_token_threshold=8)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def ckpt6(request, tmp_path_factory):
    """Six experts: divisible by 2 and 3."""
    key = "num_experts" if request.param == "qwen3_moe" else "num_local_experts"
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param + "6"),
                                **{key: 6})


@pytest.mark.parametrize("strategy", ["STRICT_PACK", "SPREAD"])
def test_ep3_matches_ep1(ray_cluster, ckpt6, strategy):
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=11)]
    want = _ids(LLM(model=str(ckpt6), **STRESS).generate(prompts, GREEDY))
    ep = LLM(model=str(ckpt6), ep_size=3, placement_strategy=strategy, **STRESS)
    try:
        assert _ids(ep.generate(prompts, GREEDY)) == want
    finally:
        ep.close()


def test_expert_count_not_divisible_is_refused(ray_cluster, qwen3_ckpt):
    with pytest.raises(ValueError, match="num_experts=8.*world_size=3|8 experts.*3"):
        LLM(model=str(qwen3_ckpt), ep_size=3, dtype="float32")


@pytest.mark.parametrize("kind", ["unknown_slot", "block_out_of_range", "bad_sampling"])
def test_invalid_command_fails_its_requests_and_the_next_step_is_right(ray_cluster, mixtral_ckpt,
                                                                         kind, ep2_mixtral):
    ep, want = ep2_mixtral
    before = [len(f) for f in ep.worker_failures()]
    ep.inject_command_fault(kind)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    outs = ep.generate(prompts, GREEDY)
    failed = [o for o in outs if o.error]
    assert failed, "the corrupted step's requests must fail"
    assert all("EpCommandFailed" in o.error for o in failed)
    assert all(o.outputs[0].finish_reason == "error" for o in failed)
    after = ep.worker_failures()
    assert [len(f) - b for f, b in zip(after, before)] == [1], after
    reason = after[0][-1]["reason"]
    assert REASONS[kind] in reason, reason
    assert any(REASONS[kind] in o.error for o in failed)
    assert _worker_log_mentions(f"EpCommandFailed step={after[0][-1]['step_id']}")
    # the requests that were not in the bad step, and every later one, are right
    for o, w in zip(outs, want):
        if not o.error:
            assert o.outputs[0].token_ids == w
    assert _ids(ep.generate(prompts, GREEDY)) == want


REASONS = {"unknown_slot": "unknown sequence", "block_out_of_range": "block id out of range",
           "bad_sampling": "temperature"}


def _worker_log_mentions(text: str, timeout_s: float = 10.0) -> bool:
    """Ray writes each worker's stderr under the session's logs folder."""
    import glob
    import os

    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for f in glob.glob(os.path.join(logs, "worker-*")):
            with open(f, errors="replace") as fh:
                if text in fh.read():
                    return True
        time.sleep(0.5)
    return False


@pytest.fixture(scope="module")
def ep2_mixtral(ray_cluster, mixtral_ckpt):
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    want = _ids(LLM(model=str(mixtral_ckpt), dtype="float32").generate(prompts, GREEDY))
    ep = LLM(model=str(mixtral_ckpt), ep_size=2, dtype="float32")
    yield ep, want
    ep.close()


def test_killed_rank_fails_in_flight_within_5s_and_group_reforms(ray_cluster, qwen3_ckpt):
    import ray

    ep = LLM(model=str(qwen3_ckpt), ep_size=2, dtype="float32")
    try:
        long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        result: dict = {}

        def run() -> None:
            result["outs"] = ep.generate([{"prompt_token_ids": [5, 6, 7]}] * 4, long)
            result["t"] = time.monotonic()

        th = threading.Thread(target=run)
        th.start()
        time.sleep(1.5)  # generation is under way
        victim = ep.worker_handles()[0]
        t_kill = time.monotonic()
        ray.kill(victim, no_restart=True)
        th.join(timeout=30)
        assert not th.is_alive(), "generate hung after a rank died"
        assert result["t"] - t_kill < 5.0
        assert all(o.error and o.outputs[0].finish_reason == "error" for o in result["outs"])
        health = ep.health()
        assert not health["healthy"] and health["reason"], health
        deadline = time.monotonic() + 120
        while not health["healthy"] and time.monotonic() < deadline:
            time.sleep(0.5)
            health = ep.health()
        assert health["healthy"], health
        out = ep.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)[0]
        assert out.error is None and len(out.outputs[0].token_ids) == NEW
    finally:
        ep.close()
