"""The head-to-client output channel (issue 19): one message per engine step at most, carrying
every request's news as deltas, whatever the number of requests or tokens; applying the
deltas gives exactly the engine's own outputs."""

from __future__ import annotations

import asyncio

from epserve import LLM, SamplingParams
from epserve.head.async_engine import AsyncEngine, Outbox
from epserve.head.output_stream import (
    OutputAccumulator, decode_records, encode_records,
)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 200 + 3 for j in range(5 + i % 7)] for i in range(n)]


async def _serve(aengine: AsyncEngine, prompts, params: SamplingParams, tokenizer):
    """Submit every prompt to one outbox and poll it as an ingress replica does."""
    outbox = Outbox("client-0")
    accs = {}
    for i, ids in enumerate(prompts):
        rid = f"r{i}"
        accs[rid] = OutputAccumulator(rid, None, ids, params.n, params.logprobs is not None,
                                      lambda t: tokenizer.decode([t]))
        aengine.submit(outbox, rid, ids, params)
    messages = records = 0
    steps0 = aengine.steps
    while any(not a.output.finished for a in accs.values()):
        frame = encode_records(await outbox.take(1.0))  # what crosses to the client
        recs = decode_records(frame)
        messages += bool(recs)
        records += len(recs)
        for rec in recs:
            accs[rec[0]].apply(rec)
    return [accs[f"r{i}"].output for i in range(len(prompts))], messages, \
        aengine.steps - steps0, records


def test_one_message_per_step_whatever_the_requests_and_tokens(demo_model_dir):
    llm = LLM(model=str(demo_model_dir), dtype="float32", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    wants = {n: llm.generate([{"prompt_token_ids": p} for p in _prompts(n)], params)
             for n in (2, 24)}
    aengine = AsyncEngine(llm.engine)  # from here on only its thread steps the engine
    try:
        for n, want in wants.items():
            prompts = _prompts(n)
            outs, messages, steps, records = asyncio.run(
                _serve(aengine, prompts, params, llm.tokenizer))
            for got, ref in zip(outs, want):  # the deltas add up to the engine's outputs
                assert got.error is None and got.finished
                c, r = got.outputs[0], ref.outputs[0]
                assert (c.token_ids, c.text, c.finish_reason) == (r.token_ids, r.text,
                                                                  r.finish_reason)
                assert [list(d) for d in c.logprobs] == [list(d) for d in r.logprobs]
                assert abs(c.cumulative_logprob - r.cumulative_logprob) < 1e-4
            assert messages <= steps + 1, (n, messages, steps)
            assert records <= n * steps
    finally:
        aengine.shutdown()


def _loop_messages(demo_model_dir, caplog, log_every_s: float, pause_s: float | None = None):
    """The head's log messages while it serves three prompts of 4 tokens (twice, ``pause_s``
    apart, when given)."""
    import logging
    import time

    llm = LLM(model=str(demo_model_dir), dtype="float32", seed=0)
    aengine = AsyncEngine(llm.engine, log_every_s=log_every_s)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        with caplog.at_level(logging.INFO, logger="epserve.head.async_engine"):
            asyncio.run(_serve(aengine, _prompts(3), params, llm.tokenizer))
            if pause_s is not None:
                time.sleep(pause_s)
                asyncio.run(_serve(aengine, _prompts(3), params, llm.tokenizer))
    finally:
        aengine.shutdown()
    return [r.getMessage() for r in caplog.records]


def test_the_loop_logs_throughput_and_every_finished_request(demo_model_dir, caplog):
    """The operator's view, as vLLM prints it: a periodic line with prompt and generation
    throughput, running/waiting requests and KV usage, then where the engine thread's time
    went; and one line per finished request."""
    import re

    msgs = _loop_messages(demo_model_dir, caplog, 0.0)
    loop = [m for m in msgs if m.startswith("engine loop")]
    assert loop, msgs
    assert re.fullmatch(r"engine loop: prompt throughput [\d.]+ tokens/s, generation throughput "
                        r"[\d.]+ tokens/s, running \d+, waiting \d+, KV cache usage [\d.]+%; "
                        r"\d+ steps in [\d.]+ s; per step [\d.]+ ms stepping, [\d.]+ ms "
                        r"handing outputs over, [\d.]+ ms between steps", loop[0]), loop[0]
    done = [m for m in msgs if m.startswith("request ")]
    assert len(done) == 3, done
    for i, p in enumerate(_prompts(3)):
        pattern = (rf"request r{i} finished \(length\): prompt {len(p)} tokens \(0 cached\), "
                   rf"4 generated in [\d.]+ s")
        assert sum(bool(re.fullmatch(pattern, m)) for m in done) == 1, (pattern, done)


def test_the_wait_for_the_next_request_is_not_time_between_steps(demo_model_dir, caplog):
    """Two waves of requests 1.2 s apart under one periodic line: the engine idled between
    them, and that wait is left out of its "between steps" figure (5 gaps in the line: with
    the wait in it read ~240 ms)."""
    import re

    msgs = _loop_messages(demo_model_dir, caplog, 1.0, pause_s=1.2)
    lines = [m for m in msgs if m.startswith("engine loop")]
    assert len(lines) == 1, lines
    between = float(re.search(r"([\d.]+) ms between steps", lines[0]).group(1))
    assert between < 100, lines[0]
