"""A step the model fails: the requests in it end with an error a client may read (the error's
type and a reference into the server log, never the internals: file paths, peer addresses),
the requests outside it go on, and the engine keeps serving."""

from __future__ import annotations

import logging

from epserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
INTERNALS = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by " \
            "peer [10.1.2.3]:29500"


def test_a_failed_step_tells_the_client_no_internals(qwen3_ckpt, caplog):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32")
    want = llm.generate([{"prompt_token_ids": [4, 5, 6]}], GREEDY)[0].outputs[0].token_ids
    model = llm.engine.model
    real = model.mixed_forward_batch
    calls = {"n": 0}

    def fail_once(*args, **kwargs):  # the model breaks once, as a lost peer would
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(INTERNALS)
        return real(*args, **kwargs)

    model.mixed_forward_batch = fail_once
    with caplog.at_level(logging.ERROR):
        out = llm.generate([{"prompt_token_ids": [7, 8, 9]}], GREEDY)[0]
    assert out.outputs[0].finish_reason == "error" and out.error
    assert "/pytorch" not in out.error and "10.1.2.3" not in out.error, out.error
    assert "RuntimeError" in out.error and "reference" in out.error
    ref = out.error.rsplit("reference ", 1)[1].rstrip(")")
    assert any(ref in r.getMessage() and "10.1.2.3" in r.getMessage() for r in caplog.records)
    # the engine goes on serving
    again = llm.generate([{"prompt_token_ids": [4, 5, 6]}], GREEDY)[0]
    assert again.error is None and again.outputs[0].token_ids == want
