"""Bounded work per request over HTTP: a request over one of the engine's limits (n, stop
strings, stop ids, logprobs, prompt and max_tokens against the context) is a 400 in OpenAI's
error shape whose ``param`` names the field, streamed or not, on both generation routes; a
request at the limits is served."""

from __future__ import annotations

import openai
import pytest

from epserve.head.limits import RequestLimits

LIMITS = RequestLimits()  # the session server runs with the defaults
CHAT = [{"role": "user", "content": "Hi"}]

OVER = [
    ("n", dict(n=LIMITS.max_n + 1)),
    ("stop", dict(stop=[f"s{i}" for i in range(LIMITS.max_stop_strings + 1)])),
    ("stop", dict(stop=["x" * (LIMITS.max_stop_chars + 1)])),
    ("stop_token_ids", dict(extra_body={
        "stop_token_ids": list(range(LIMITS.max_stop_token_ids + 1))})),
    ("prompt_logprobs", dict(extra_body={"prompt_logprobs": LIMITS.max_logprobs + 1})),
]


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    assert e.value.status_code == 400
    return e.value


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, kw", OVER, ids=[f"{f}-{i}" for i, (f, _) in enumerate(OVER)])
def test_over_a_limit_is_a_400_naming_the_field(server, client, field, kw, stream):
    err = _refused(client.completions.create, model=server.model, prompt="Hello",
                   max_tokens=2, stream=stream, **kw)
    assert err.param == field, err.body
    err = _refused(client.chat.completions.create, model=server.model, messages=CHAT,
                   max_tokens=2, stream=stream, **kw)
    assert err.param == field, err.body


def test_logprobs_over_the_limit_name_the_field(server, client):
    err = _refused(client.completions.create, model=server.model, prompt="Hello", max_tokens=2,
                   logprobs=LIMITS.max_logprobs + 1)
    assert err.param == "logprobs", err.body


def test_prompt_and_max_tokens_are_bounded_by_the_context(server, client):
    err = _refused(client.completions.create, model=server.model, prompt="Hello",
                   max_tokens=10**6)
    assert err.param == "max_tokens" and err.code == "context_length_exceeded", err.body
    err = _refused(client.completions.create, model=server.model,
                   prompt=[5] * 10**5, max_tokens=2)
    assert err.param == "prompt" and err.code == "context_length_exceeded", err.body


def test_a_request_at_the_limits_is_served(server, client):
    size = LIMITS.max_stop_chars // LIMITS.max_stop_strings
    stops = [f"{i:04d}".rjust(size, "\u2603") for i in range(LIMITS.max_stop_strings)]
    out = client.completions.create(model=server.model, prompt="Hello", max_tokens=4, n=2,
                                    stop=stops, logprobs=LIMITS.max_logprobs, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert len(out.choices) == 2
    assert all(c.finish_reason == "length" for c in out.choices)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_huge_n_is_refused_at_once_and_costs_nobody(server, client, route):
    """n in the millions is refused before anything is built per choice: quickly, and
    /health answers meanwhile as fast as ever."""
    import threading
    import time

    import requests

    health: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            t = time.perf_counter()
            requests.get(f"{server.base}/health", timeout=30)
            health.append(time.perf_counter() - t)

    th = threading.Thread(target=poll_health)
    th.start()
    t0 = time.perf_counter()
    try:
        if route == "completions":
            err = _refused(client.completions.create, model=server.model, prompt="Hi",
                           max_tokens=2, n=4_000_000)
        else:
            err = _refused(client.chat.completions.create, model=server.model, messages=CHAT,
                           max_tokens=2, n=4_000_000)
        took = time.perf_counter() - t0
    finally:
        done.set()
        th.join()
    assert err.param == "n", err.body
    assert took < 1.0, f"refused after {took:.2f} s"
    assert max(health) < 1.0, f"/health took {max(health):.2f} s meanwhile"
