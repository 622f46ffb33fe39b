"""Speculative decoding (n-gram drafts) over expert parallelism, as users of N ranks see it.

``LLM(ep_size=2)`` (and an engine over three ranks, below) with ``speculative_config`` give
the tokens (and log-probabilities) of one rank with and without speculation, on a batch with
chunked prefill, a prefix-cache hit, preemption, seeded sampling and prompts whose repeated
phrases the model loops on (so drafts are accepted, verify rows carry several tokens and rejected tails are
rewound on every rank). A malformed verify row or rewind in one step's command is refused by
every rank alike: only the request it names fails, with the refusal as its error; the other
requests of that step and the next requests come out exactly as on one rank. That holds when
the leader's own record of a rewind is wrong too: the step is issued again without the
sequence's rewind (it used to carry it again, be refused again, and loop without end).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time

import pytest

from epserve import LLM, SamplingParams
from tiny_ckpt import make_tiny_checkpoint
from worker_logs import worker_log_mentions

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
# small blocks, a small pool and a small token budget: chunked prefill and preemption happen
STRESS = dict(dtype="float32", block_size=4, num_kv_blocks=24, max_num_batched_tokens=24,
              long_prefill_token_threshold=8)
NEW = 32


def _prompt(seed: int) -> list[int]:
    """A few random tokens, then their first three repeated three times: the tiny random
    model falls into loops on these, which n-gram lookup predicts."""
    rng = random.Random(seed)
    own = [rng.randrange(3, 300) for _ in range(rng.randrange(3, 10))]
    return own + own[:3] * 3


PROMPTS = [{"prompt_token_ids": _prompt(s)} for s in (11, 8, 5, 1, 7, 3, 0)]
PROMPTS.append(dict(PROMPTS[1]))  # the same prompt again: a prefix-cache hit
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
PARAMS = [GREEDY] * 5 + [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=NEW,
                                        ignore_eos=True, logprobs=1) for s in (1, 2)] + [GREEDY]
LOOP = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # PROMPTS[0] alone


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_same(outs, want) -> None:
    """Token-identical, each position's log-probabilities (same tokens) within 1e-5."""
    assert [o.error for o in outs] == [None] * len(want)
    assert _ids(outs) == _ids(want)
    for o, w in zip(outs, want):
        for got, exp in zip(o.outputs[0].logprobs, w.outputs[0].logprobs):
            assert sorted(got) == sorted(exp)
            assert all(abs(got[t].logprob - exp[t].logprob) <= 1e-5 for t in exp), (got, exp)


@pytest.fixture(scope="module")
def ckpt6(tmp_path_factory):
    """Six experts: divisible by 2 and 3."""
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("spec6"), num_experts=6)


@pytest.fixture(scope="module")
def one_rank(ckpt6):
    """One rank without and with speculation agree; the outputs every EP run must give."""
    plain = LLM(model=str(ckpt6), **STRESS)
    want = plain.generate(PROMPTS, PARAMS)
    want_loop = plain.generate([PROMPTS[0]], LOOP)[0].outputs[0].token_ids
    spec = LLM(model=str(ckpt6), speculative_config=SPEC, **STRESS)
    _assert_same(spec.generate(PROMPTS, PARAMS), want)
    assert spec.engine.stats.spec.num_accepted_tokens > 0, spec.engine.stats.spec
    assert spec.generate([PROMPTS[0]], LOOP)[0].outputs[0].token_ids == want_loop
    for llm in (plain, spec):
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    return want, want_loop


def _settled(llm: LLM, generated: int) -> dict:
    """The head's counters once they count ``generated`` tokens (the engine thread publishes
    them just after handing the outputs over)."""
    deadline = time.monotonic() + 10
    while True:
        stats = llm.stats()
        if stats["generation_tokens"] >= generated and not stats["num_running"]:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


@pytest.mark.parametrize("ep_size", [2])  # three ranks: the fault tests' group below
def test_speculation_over_ep_gives_the_one_rank_outputs(ray_cluster, ckpt6, one_rank, ep_size):
    """The batch's tokens and logprobs equal one rank's (with and without speculation), the
    batch preempted and hit the prefix cache, and drafts were accepted."""
    want, want_loop = one_rank
    ep = LLM(model=str(ckpt6), ep_size=ep_size, speculative_config=SPEC, **STRESS)
    try:
        _assert_same(ep.generate(PROMPTS, PARAMS), want)
        before = _settled(ep, NEW * len(PROMPTS))
        assert before["num_preemptions"] > 0 and before["prefix_cache_hits"] > 0, before
        # one request alone: without speculation each step gives it at most one token, so
        # fewer steps than tokens means drafts were accepted (verified on the ranks)
        assert ep.generate([PROMPTS[0]], LOOP)[0].outputs[0].token_ids == want_loop
        after = _settled(ep, before["generation_tokens"] + LOOP.max_tokens)
        steps = after["steps"] - before["steps"]
        assert after["generation_tokens"] - before["generation_tokens"] == LOOP.max_tokens
        assert steps < LOOP.max_tokens, (steps, after)
        spec = after["spec_decode"]  # the head's speculation counters
        assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"], spec
    finally:
        ep.close()


def test_a_draft_model_over_ep_gives_the_one_rank_outputs(ray_cluster, ckpt6, one_rank):
    """The draft model runs on the head beside rank 0 (here the target itself: every greedy
    draft is accepted); over two ranks the batch comes out as on one rank."""
    want, _ = one_rank
    spec = {"method": "draft_model", "model": str(ckpt6), "num_speculative_tokens": 3}
    ep = LLM(model=str(ckpt6), ep_size=2, speculative_config=spec, **STRESS)
    try:
        _assert_same(ep.generate(PROMPTS, PARAMS), want)
        got = _settled(ep, NEW * len(PROMPTS))["spec_decode"]
        assert 0 < got["num_accepted_tokens"] <= got["num_draft_tokens"], got
    finally:
        ep.close()


# --------------------------------------------------------------------------- faults

KINDS = ("draft_out_of_vocab", "draft_past_kv", "rewind_forward")


def _kv_after(cmd, mirror, key: tuple[int, int]) -> tuple[int, int]:
    """``key``'s KV length and block count once ``cmd``'s rewinds and block updates apply."""
    at, nb = int(mirror.seq_len[key]), int(mirror.nblocks[key])
    for r in cmd.rewinds:
        if (r.rank, r.slot) == key:
            at, nb = r.seq_len, r.nblocks
    for b in cmd.block_updates:
        if (b.rank, b.slot) == key:
            nb = b.first + len(b.blocks)
    return at, nb


def _corrupt(kind: str, fired: dict, leader):
    """A fault for the leader's ``inject_fault``: leaves a command without what ``kind``
    corrupts as it is (the test injects it again); otherwise records the sequence it blames
    and the reason every rank must give in ``fired``. ``rewind_forward`` corrupts the
    leader's own record of the rewind too (a leader bug: every command it builds carries
    the rewind until the sequence is dropped)."""

    def mutate(cmd, mirror):
        rows = {(r.rank, r.slot) for r in (*cmd.decode, *cmd.verify, *cmd.prefill)}
        rows.update(mirror.kept_rows(cmd))  # a repeat's decode rows
        if kind == "rewind_forward":  # a rewind may only go back: this one goes forward
            hit = [r for r in cmd.rewinds if (r.rank, r.slot) in rows]
            if not hit:
                return cmd
            r = hit[0]
            key, grown = (r.rank, r.slot), int(mirror.seq_len[r.rank, r.slot]) + 1
            fired.update(key=key, reason=f"rewind of {key} to {grown} tokens",
                         step_id=cmd.step_id, rows=len(rows))
            leader.view.pending_rewinds[key] = (grown, r.nblocks)
            return dataclasses.replace(cmd, rewinds=tuple(
                dataclasses.replace(x, seq_len=grown) if x is r else x for x in cmd.rewinds))
        if not cmd.verify:
            return cmd
        v = cmd.verify[0]
        key = (v.rank, v.slot)
        if kind == "draft_out_of_vocab":
            drafts = tuple(v.drafts[:-1]) + (mirror.vocab_size + 5,)
            reason = f"verify row {key}: token outside the vocab"
        else:  # drafts up to the first position past the sequence's last block
            at, nb = _kv_after(cmd, mirror, key)
            k = nb * mirror.block_size - at
            drafts = (tuple(v.drafts) * k)[:k]
            reason = f"verify row {key}: no KV block for position {at + k}"
        fired.update(key=key, reason=reason, step_id=cmd.step_id, rows=len(rows))
        return dataclasses.replace(cmd, verify=(dataclasses.replace(v, drafts=drafts),)
                                   + tuple(cmd.verify[1:]))

    return mutate


def _drive(group, engine, mutate=None, fired=None, timeout_s: float = 120.0
           ) -> tuple[list, dict]:
    """PROMPTS through ``engine`` step by step (``mutate`` injected before each step until it
    fires); the outputs in order, and who held each (rank, slot) in the step it fired in.
    Stepped on a thread: a leader that re-issues a refused step without end fails the test
    within ``timeout_s`` (the ranks are killed, which ends its loop) instead of hanging it."""
    reqs = [engine.add_request(None, p["prompt_token_ids"], sp)
            for p, sp in zip(PROMPTS, PARAMS)]
    final, owners, box = {}, {}, {}

    def run() -> None:
        try:
            while engine.has_unfinished():
                if mutate is not None and not fired:
                    owners.clear()
                    owners.update({(s.state.rank, s.state.slot_idx): s.request.request_id
                                   for s in engine.scheduler.running if s.state is not None})
                    group.leader.inject_fault(mutate)
                for out in engine.step(finished_only=True):
                    final[out.request_id] = out
        except BaseException as exc:  # handed to the test, which raises it
            box["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout_s)
    if th.is_alive():
        import ray

        for w in group.workers:
            ray.kill(w, no_restart=True)
        th.join(60)
        pytest.fail(f"the engine did not finish the batch within {timeout_s:.0f} s "
                    f"(the leader kept issuing refused commands?); fault {fired}")
    if "error" in box:
        raise box["error"]
    return [final[r.request_id] for r in reqs], owners


@pytest.fixture(scope="module")
def ep3_engine(ray_cluster, ckpt6):
    """An engine in this process over a three-rank group, so a test can corrupt the exact
    command that carries a verify row (the head actor's engine cannot be stepped)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from epserve.cluster.engine_args import EngineArgs, build_engine
    from epserve.cluster.ep_group import EpGroup, bundle

    args = EngineArgs(model=str(ckpt6), ep_size=3, speculative_config=SPEC, **STRESS).resolved()
    pg = placement_group([bundle("cpu")] * 3, strategy="STRICT_PACK")
    ray_cluster.get(pg.ready(), timeout=60)
    group = EpGroup(args, pg)
    group.join()
    try:
        yield group, build_engine(args, runner=group.leader)[0]
    finally:
        group.shutdown(graceful=True)
        remove_placement_group(pg)


@pytest.mark.parametrize("kind", KINDS)
def test_a_malformed_verify_command_fails_only_its_request(ray_cluster, one_rank, ep3_engine,
                                                           kind):
    """Every rank refuses the corrupted command (ranks 1 and 2 log ``EpCommandFailed``, rank
    0 raises it); the leader fails just the sequence it names and runs the step again
    without it: the other requests of that step, and the next batch, equal one rank's."""
    want, _ = one_rank
    group, engine = ep3_engine
    workers = group.workers
    before = [len(f) for f in ray_cluster.get([w.failures.remote() for w in workers])]
    fired: dict = {}
    outs, owners = _drive(group, engine, _corrupt(kind, fired, group.leader), fired)
    assert fired, f"no command carried what {kind} corrupts"
    failed = [i for i, o in enumerate(outs) if o.error]
    bad = [i for i, o in enumerate(outs) if o.request_id == owners.get(fired["key"])]
    assert failed == bad and len(bad) == 1, ([o.error for o in outs], fired, owners)
    (i,) = failed
    assert outs[i].outputs[0].finish_reason == "error"
    assert outs[i].error.startswith("this request's step was refused: " + fired["reason"])
    got = outs[i].outputs[0].token_ids  # what it had before the refused step was right
    assert got == want[i].outputs[0].token_ids[:len(got)]
    others = [j for j in range(len(outs)) if j != i]
    _assert_same([outs[j] for j in others], [want[j] for j in others])
    after = ray_cluster.get([w.failures.remote() for w in workers])
    assert [len(f) - b for f, b in zip(after, before)] == [1] * len(workers), after
    records = [f[-1] for f in after]
    assert len({(r["step_id"], r["reason"]) for r in records}) == 1, records  # alike
    assert records[0]["reason"].startswith(fired["reason"]), (records, fired)
    assert records[0]["reason"] in outs[i].error
    # the refused step carried other sequences' rows, which ran when it was issued again
    assert fired["rows"] > 1 and records[0]["step_id"] == fired["step_id"], fired
    for w in workers:
        pid = ray_cluster.get(w.pid.remote())
        line = f"EpCommandFailed step={records[0]['step_id']} reason={records[0]['reason']}"
        assert worker_log_mentions(line, pid=pid), (pid, line)
    nxt, _ = _drive(group, engine)  # the ranks go on, in step, with every request right
    _assert_same(nxt, want)
