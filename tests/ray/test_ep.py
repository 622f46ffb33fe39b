"""Expert parallelism on a local Ray cluster (gloo on loopback), as a user of LLM(ep_size=N) sees it.

Outputs over N ranks equal one rank's and transformers', with sequences spread over ranks,
chunked prefill, prefix-cache hits and preemption in the mix; an invalid step command fails
only its requests on every rank and the next commands are right; a killed rank fails the
in-flight requests within 5 s, health turns unhealthy, the group re-forms and serves again.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from epserve import LLM, SamplingParams
from tiny_ckpt import make_tiny_checkpoint
from worker_logs import worker_log_mentions

NEW = 24


def _prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 300) for _ in range(13)]
    own = [[rng.randrange(3, 300) for _ in range(n)] for n in (3, 9, 17, 4, 28, 6, 11, 22)]
    # half the prompts share a 13-token prefix: prefix-cache hits on the second pass
    return [shared + p if i % 2 else p for i, p in enumerate(own)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
# every other prompt penalized: each rank keeps its own sequences' token histories
PENALIZED = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0,
                           presence_penalty=0.9, frequency_penalty=0.6, repetition_penalty=1.4)
# small blocks, a small pool and a small token budget: chunked prefill and preemption happen
STRESS = dict(dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24,
              long_prefill_token_threshold=8)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _ckpt6(arch: str, tmp_path_factory):
    """Six experts: divisible by 2 and 3."""
    key = "num_experts" if arch == "qwen3_moe" else "num_local_experts"
    return make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch + "6"), **{key: 6})


# each architecture and each placement strategy once: the strategy only reaches the placement
# group (on this one node both put the three ranks here), the architecture the ranks' model
@pytest.mark.parametrize("arch, strategy", [("qwen3_moe", "STRICT_PACK"),
                                            ("mixtral", "SPREAD")])
def test_ep3_matches_ep1(ray_cluster, tmp_path_factory, arch, strategy):
    ckpt6 = _ckpt6(arch, tmp_path_factory)
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=11)]
    params = [PENALIZED if i % 2 else GREEDY for i in range(len(prompts))]
    want = _ids(LLM(model=str(ckpt6), **STRESS).generate(prompts, params))
    ep = LLM(model=str(ckpt6), ep_size=3, placement_strategy=strategy, **STRESS)
    try:
        assert _ids(ep.generate(prompts, params)) == want
    finally:
        ep.close()


def test_expert_count_not_divisible_is_refused(ray_cluster, qwen3_ckpt):
    with pytest.raises(ValueError, match="num_experts=8.*world_size=3|8 experts.*3"):
        LLM(model=str(qwen3_ckpt), ep_size=3, dtype="float32")


@pytest.mark.parametrize("kind", ["unknown_slot", "block_out_of_range", "bad_sampling"])
def test_invalid_command_fails_only_the_rows_that_made_it_invalid(ray_cluster, mixtral_ckpt,
                                                                  kind, ep2_mixtral):
    """Every rank refuses the corrupted command alike (a worker logs EpCommandFailed); the
    leader then fails only the sequence whose row made it invalid and runs the step again
    without it: every other request in that step comes out exactly as on one rank."""
    ep, want = ep2_mixtral
    before = [len(f) for f in ep.backend.worker_failures()]
    ep.backend.inject_command_fault(kind)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    outs = ep.generate(prompts, GREEDY)
    failed = [i for i, o in enumerate(outs) if o.error]
    # unknown_slot adds a row of a sequence no request owns: nobody fails; the other faults
    # corrupt the first row's sequence (the first prompt): that request alone fails
    assert failed == ([] if kind == "unknown_slot" else [0]), [o.error for o in outs]
    for i in failed:
        assert REASONS[kind] in outs[i].error and "refused" in outs[i].error, outs[i].error
        assert outs[i].outputs[0].finish_reason == "error"
    after = ep.backend.worker_failures()
    assert [len(f) - b for f, b in zip(after, before)] == [1], after
    reason = after[0][-1]["reason"]
    assert REASONS[kind] in reason, reason
    assert worker_log_mentions(f"EpCommandFailed step={after[0][-1]['step_id']}")
    for i, (o, w) in enumerate(zip(outs, want)):
        if i not in failed:
            assert o.error is None and o.outputs[0].token_ids == w
    assert _ids(ep.generate(prompts, GREEDY)) == want


REASONS = {"unknown_slot": "unknown sequence", "block_out_of_range": "block id out of range",
           "bad_sampling": "temperature"}


@pytest.fixture(scope="module")
def ep2_mixtral(ray_cluster, mixtral_ckpt):
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    want = _ids(LLM(model=str(mixtral_ckpt), dtype="float32").generate(prompts, GREEDY))
    ep = LLM(model=str(mixtral_ckpt), ep_size=2, dtype="float32")
    yield ep, want
    ep.close()


def _in_background(fn) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test, which asserts on it
            box["error"] = exc
        box["t"] = time.monotonic()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def _wait_unhealthy(ep, since: float, within_s: float) -> float:
    """Poll health every 0.1 s; each answer must come within 1 s. Seconds until unhealthy."""
    while time.monotonic() - since < within_s:
        t0 = time.monotonic()
        h = ep.health()
        assert time.monotonic() - t0 < 1.0, "health took more than a second to answer"
        if not h["healthy"]:
            assert h["reason"], h
            return time.monotonic() - since
        time.sleep(0.1)
    raise AssertionError(f"health still said healthy {within_s} s after the rank failed")


def _wait_healthy(ep, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ep.health()["healthy"]:
        assert time.monotonic() < deadline, ep.health()
        time.sleep(0.2)


LONG = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
LONG_PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7], [9, 4, 2, 8], [11] * 6, [3, 1])]


@pytest.fixture(scope="module")
def ep2_qwen(ray_cluster, qwen3_ckpt):
    want = _ids(LLM(model=str(qwen3_ckpt), dtype="float32").generate(LONG_PROMPTS, LONG))
    ep = LLM(model=str(qwen3_ckpt), ep_size=2, dtype="float32")
    yield ep, want
    ep.close()


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_failed_rank_requests_go_on_in_the_reformed_group(ray_cluster, ep2_qwen, fault):
    """A rank killed or frozen (SIGSTOP) mid-generation: health answers within a second the
    whole time and turns unhealthy within 5 s; the group re-forms; the in-flight requests and
    one sent during the re-form complete with every token, exactly as on one rank."""
    import os
    import signal

    ep, want = ep2_qwen
    th, box = _in_background(lambda: ep.generate(LONG_PROMPTS, LONG))
    time.sleep(1.5)  # generation is under way
    assert th.is_alive(), "generation ended before the fault: make LONG longer"
    victim = ep.backend.worker_handles()[0]
    pid = ray_cluster.get(victim.pid.remote())
    t_fault = time.monotonic()
    if fault == "kill":
        ray_cluster.kill(victim, no_restart=True)
    else:
        os.kill(pid, signal.SIGSTOP)
    try:
        assert _wait_unhealthy(ep, t_fault, within_s=5.0) < 5.0
        t0 = time.monotonic()
        assert ep.stats()["num_running"] == len(LONG_PROMPTS)  # answered while a step is stuck
        assert time.monotonic() - t0 < 1.0
        late, late_box = _in_background(
            lambda: ep.generate([LONG_PROMPTS[0]], SamplingParams(
                temperature=0.0, max_tokens=8, ignore_eos=True)))
        th.join(timeout=180)
        late.join(timeout=60)
    finally:
        if fault == "freeze":
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # the watchdog killed it: what it should do
                pass
    assert not th.is_alive() and not late.is_alive(), "generate hung after a rank failed"
    assert "error" not in box and "error" not in late_box, (box, late_box)
    outs = box["value"]
    assert [o.error for o in outs] == [None] * len(outs)
    assert _ids(outs) == want
    assert late_box["value"][0].error is None
    assert late_box["value"][0].outputs[0].token_ids == want[0][:8]
    _wait_healthy(ep)
    assert _ids(ep.generate(LONG_PROMPTS, LONG)) == want


def test_reforms_do_not_grow_head_memory(ray_cluster, ep2_qwen):
    """Each re-form builds a new group and engine; the old ones must be freed, not kept
    (the head's memory after the third re-form against after the first)."""
    ep, _ = ep2_qwen
    head = ep.backend.head
    rss = []
    for _ in range(3):
        ray_cluster.kill(ep.backend.worker_handles()[0], no_restart=True)
        _wait_unhealthy(ep, time.monotonic(), within_s=5.0)
        _wait_healthy(ep)
        assert ep.generate([LONG_PROMPTS[0]], GREEDY)[0].error is None
        rss.append(ray_cluster.get(head.memory_rss.remote()))
    growth = rss[-1] - rss[0]
    assert growth < 60 * 2**20, [r // 2**20 for r in rss]


def test_stream_over_ep_grows_to_the_batch_output_and_closing_aborts(ray_cluster, ep2_qwen):
    """LLM.stream over EP rides the head's client channel (submit, then poll for deltas):
    each output it yields extends the last and the last equals generate's; closing the
    iterator early aborts the request, and the engine stays free for the next one."""
    ep, want = ep2_qwen
    outs = list(ep.stream(LONG_PROMPTS[0], LONG))
    ids = [o.outputs[0].token_ids for o in outs]
    assert all(a == b[:len(a)] for a, b in zip(ids, ids[1:])) and len(outs) > 2
    assert outs[-1].finished and ids[-1] == want[0]
    it = ep.stream(LONG_PROMPTS[1], LONG)
    next(it)
    it.close()
    deadline = time.monotonic() + 10
    while ep.stats()["num_running"]:
        assert time.monotonic() < deadline, ep.stats()
        time.sleep(0.1)
    assert _ids(ep.generate(LONG_PROMPTS[:2], LONG)) == want[:2]


def test_an_idle_ep_group_stays_up_past_its_collective_timeout(ray_cluster, qwen3_ckpt):
    """Idle ranks wait in the command broadcast, which times out after ``ep_timeout_s``: the
    leader's empty steps keep them there, so an idle engine stays healthy (no re-form) and
    serves the next request exactly."""
    # 2.5 s: the leader's empty step comes every 0.625 s, so the ranks' broadcast survives a
    # 1.9 s stall of the leader (held idle with 2.0 s beside two busy loops on the 2 cores)
    ep = LLM(model=str(qwen3_ckpt), ep_size=2, dtype="float32", ep_timeout_s=2.5)
    try:
        want = _ids(ep.generate([LONG_PROMPTS[0]], GREEDY))
        deadline = time.monotonic() + 6.0  # two collective timeouts of silence, and 1 s
        while time.monotonic() < deadline:
            h = ep.health()
            assert h["healthy"], h
            time.sleep(0.2)
        assert _ids(ep.generate([LONG_PROMPTS[0]], GREEDY)) == want
        assert ep.backend.worker_failures() == [[]]
    finally:
        ep.close()


def test_a_corrupt_checkpoint_is_refused_with_the_loaders_error(ray_cluster, qwen3_ckpt,
                                                                tmp_path):
    """Weights that do not load (a truncated safetensors file): LLM(ep_size=2) raises one
    ValueError naming the checkpoint and the loader's error, and gives back the CPUs it
    reserved for its ranks (its placement group)."""
    import shutil

    def reserved() -> set[str]:
        return {pg for pg, v in ray_cluster.util.placement_group_table().items()
                if v["state"] != "REMOVED"}

    bad = shutil.copytree(qwen3_ckpt, tmp_path / "bad")
    for f in bad.glob("*.safetensors"):
        f.write_bytes(b"\0" * 64)
    before = reserved()
    with pytest.raises(ValueError, match=rf"the engine could not start on {bad}: .*"
                                         r"not a readable safetensors file \(.*header"):
        LLM(model=str(bad), ep_size=2, dtype="float32")
    assert reserved() == before
