"""Request values are coerced as vLLM's request models (pydantic, lax) coerce them: a client
that sends ``"max_tokens": "4"``, ``"temperature": "0"``, ``"n": 2.0`` or ``"stream": "false"``
gets what the typed request gets, on completions, chat and responses; what cannot be coerced,
or would be a NaN or an infinity, is a 400 naming the field."""

from __future__ import annotations

import json

import pytest
import requests

CHAT = [{"role": "user", "content": "Hi"}]


def _post(server, route: str, body: dict) -> requests.Response:
    return requests.post(server.base + route, data=json.dumps(body).encode(), timeout=120,
                         headers={"Content-Type": "application/json", **server.auth})


def _texts(r: requests.Response) -> list[str]:
    assert r.status_code == 200, r.text
    body = r.json()
    return [c.get("text", c.get("message", {}).get("content")) for c in body["choices"]]


@pytest.mark.parametrize("route, base", [
    ("/v1/completions", {"prompt": "Once upon"}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_coerced_values_give_the_typed_requests_output(server, route, base):
    typed = {**base, "model": server.model, "max_tokens": 4, "temperature": 0.0, "n": 2,
             "seed": 3, "stream": False, "ignore_eos": True}
    loose = {**base, "model": server.model, "max_tokens": "4", "temperature": "0", "n": 2.0,
             "seed": " 3 ", "stream": "false", "ignore_eos": "yes"}
    want = _texts(_post(server, route, typed))
    assert _texts(_post(server, route, loose)) == want


def test_responses_coerces_too(server):
    typed = {"model": server.model, "input": "Hi", "max_output_tokens": 16, "temperature": 0}
    loose = {**typed, "max_output_tokens": "16", "temperature": "0.0"}
    outs = []
    for body in (typed, loose):
        r = _post(server, "/v1/responses", body)
        assert r.status_code == 200, r.text
        outs.append([item["content"] for item in r.json()["output"]])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "4.5"), ("max_tokens", "four"), ("temperature", "nan"),
    ("temperature", "inf"), ("top_p", "Infinity"), ("n", 2.5), ("stream", "maybe"),
    ("ignore_eos", 2),
])
def test_what_cannot_be_coerced_is_a_400_naming_it(server, field, value):
    r = _post(server, "/v1/completions", {"model": server.model, "prompt": "Hi",
                                          "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text
