"""One client leaving mid-stream never fails another request on the same ingress (the
replica's submit and poll tasks are not the leaving request's)."""

from __future__ import annotations

import json

import requests


def test_a_dropped_stream_spares_the_other_streams(server):
    body = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 40, "temperature": 0,
            "stream": True, "ignore_eos": True}
    url = f"{server.v1}/completions"
    a = requests.post(url, json=body, headers=server.auth, stream=True, timeout=60)
    b = requests.post(url, json=body, headers=server.auth, stream=True, timeout=60)
    lines_a = a.iter_lines()
    next(x for x in lines_a if x.startswith(b"data: {"))  # A is under way
    a.close()  # its client leaves
    chunks = [json.loads(x[6:]) for x in b.iter_lines() if x.startswith(b"data: {")]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert sum(len(c["choices"][0]["text"]) >= 0 for c in chunks if c.get("choices")) > 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "length", chunks[-1]
    # and the ingress serves the next request as ever
    r = requests.post(url, json={**body, "stream": False}, headers=server.auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
