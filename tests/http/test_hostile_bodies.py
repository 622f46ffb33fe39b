"""Raw HTTP against the live server: hundreds of malformed or hostile bodies, each answered
with a 4xx in OpenAI's error shape, and the server still serving valid requests after. A
value vLLM's request models coerce (``"5"`` for an int) is not malformed: test_input_coercion."""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ConfigDict, TypeAdapter, ValidationError

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
VALID = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
SESSION = requests.Session()


def _post(server, route: str, data: bytes, headers: dict | None = None) -> requests.Response:
    h = {"Content-Type": "application/json", **server.auth, **(headers or {})}
    return SESSION.post(server.base + route, data=data, headers=h, timeout=60)


def _assert_openai_error(r: requests.Response, lo: int = 400, hi: int = 499) -> dict:
    assert lo <= r.status_code <= hi, (r.status_code, r.text[:500])
    body = r.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    return err


# ---------------------------------------------------------------------- strategies

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30),
                          st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_json = st.recursive(_json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6)


_LAX = ConfigDict(allow_inf_nan=False)


def _not(*types):
    """JSON values that vLLM's request models (pydantic, lax) coerce into none of ``types``:
    ``"5"`` or ``true`` is an int there, ``"0.5"`` a float, ``"yes"`` a bool."""
    adapters = [TypeAdapter(t, config=_LAX if t in (int, float, bool, str) else None)
                for t in types]

    def refused(v) -> bool:
        for a in adapters:
            try:
                a.validate_python(v)
                return False
            except ValidationError:
                pass
        return True
    return _json.filter(refused)


_huge = st.one_of(st.integers(10**12, 10**40), st.integers(-(10**40), -1))

# field -> values that are never valid for it, on both generation routes
_BAD_FIELDS = {
    "max_tokens": st.one_of(_not(int, type(None)), st.integers(-(10**9), 0),
                            st.integers(10**5, 10**40)),
    "temperature": st.one_of(_not(int, float, type(None)), st.floats(-1e9, -1e-3),
                             st.just(10**400)),
    "top_p": st.one_of(_not(int, float, type(None)), st.floats(1.0001, 1e6),
                       st.floats(-1e6, 0.0)),
    "top_k": st.one_of(_not(int, type(None)), st.integers(-(10**40), -2),
                       st.integers(2**31, 10**40)),
    "min_p": st.one_of(_not(int, float, type(None)), st.floats(1.0001, 1e6),
                       st.floats(-1e6, -1e-6)),
    "n": st.one_of(_not(int), st.integers(-(10**40), 0), st.integers(129, 10**40)),
    "seed": st.one_of(_not(int, type(None)), st.integers(2**64, 10**40)),
    "stop": _json.filter(lambda v: not (v is None or isinstance(v, str) or (
        isinstance(v, list) and all(isinstance(s, str) for s in v)))) | st.just([""]),
    "stop_token_ids": st.one_of(_not(list, type(None)), st.lists(_huge, min_size=1, max_size=3)),
    "ignore_eos": _not(bool),
    "min_tokens": st.one_of(_not(int), st.integers(-(10**9), -1)),
    "stream": _not(bool),
    "prompt_logprobs": st.one_of(_not(int, type(None)), st.integers(21, 10**40),
                                 st.integers(-(10**9), -1)),
    "stream_options": st.one_of(_not(dict, type(None)), st.just({"include_usage": 3})),
    "user": _not(str, type(None)),
    "model": st.one_of(_not(str, type(None)), st.text(min_size=1, max_size=10)),
}
_COMPLETION_ONLY = {
    "prompt": st.one_of(
        _json.filter(lambda v: not isinstance(v, (str, list))),
        st.just([]), st.lists(st.floats(allow_nan=False).filter(lambda f: f != int(f)),
                              min_size=1, max_size=3),
        st.lists(_huge, min_size=1, max_size=3), st.just([[]]), st.just(["a", 1]),
        st.just([0] * 5000), st.just("")),
    "logprobs": st.one_of(_not(int, type(None)), st.integers(21, 10**40),
                          st.integers(-(10**9), -1)),
    "echo": _not(bool),
}
_CHAT_ONLY = {
    "messages": st.one_of(
        _not(list), st.just([]),
        st.lists(_json.filter(lambda v: not isinstance(v, dict)), min_size=1, max_size=2),
        st.just([{"role": "", "content": "x"}]), st.just([{"role": "a b\n", "content": "x"}]),
        st.just([{"content": "x"}]),
        st.just([{"role": "user", "content": 5}]),
        st.just([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        st.just([{"role": "user", "content": "word " * 6000}])),
    "logprobs": _not(bool),
    "top_logprobs": st.one_of(_not(int, type(None)), st.integers(21, 10**40)),
    "max_completion_tokens": st.one_of(_not(int, type(None)), st.integers(-(10**9), 0)),
}


@st.composite
def bad_field_body(draw) -> tuple[str, bytes]:
    """A valid request with exactly one field made invalid (or a required one removed)."""
    route = draw(st.sampled_from(ROUTES[:2]))
    body = dict(VALID[route])
    fields = {**_BAD_FIELDS, **(_COMPLETION_ONLY if route == ROUTES[0] else _CHAT_ONLY)}
    name = draw(st.sampled_from(sorted(fields)))
    if name in ("prompt", "messages") and draw(st.booleans()):
        body.pop(name)
    else:
        value = draw(fields[name])
        if name == "model" and isinstance(value, str) and value == "demo":
            value = "demo-not"
        body[name] = value
        if name == "stream_options":
            body["stream"] = True
    return route, json.dumps(body).encode()


@st.composite
def broken_bytes(draw) -> tuple[str, bytes]:
    """Bodies that are not a JSON object at all, or not UTF-8, or too deep, on any route."""
    route = draw(st.sampled_from(ROUTES))
    valid = json.dumps(VALID[route]).encode()
    kind = draw(st.sampled_from(["random", "truncated", "bad_utf8", "surrogate", "deep",
                                 "not_object", "nan", "empty", "huge_number"]))
    if kind == "random":
        data = draw(st.binary(max_size=64).filter(lambda b: not _is_json_object(b)))
    elif kind == "truncated":
        data = valid[:draw(st.integers(0, len(valid) - 1))]
    elif kind == "bad_utf8":
        data = valid.replace(b"H" if b"H" in valid else b"[", draw(st.sampled_from(
            [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])), 1)
    elif kind == "surrogate":
        data = valid.replace(b"Hello" if b"Hello" in valid else b"Hi",
                             b"\\ud800x").replace(b"[1, 2, 3]", b'"\\udfff"')
    elif kind == "deep":
        d = draw(st.integers(40, 200_000))
        data = b'{"prompt": ' + b"[" * d + b"]" * d + b"}"
    elif kind == "not_object":
        data = json.dumps(draw(_json.filter(lambda v: not isinstance(v, dict)))).encode()
    elif kind == "nan":
        data = valid[:-1] + b', "temperature": ' + draw(st.sampled_from(
            [b"NaN", b"Infinity", b"-Infinity", b"1e400"])) + b"}"
    elif kind == "huge_number":
        data = valid[:-1] + b', "max_tokens": ' + b"9" * draw(st.integers(5000, 20000)) + b"}"
    else:
        data = draw(st.sampled_from([b"", b"   ", b"null"]))
    return route, data


def _is_json_object(b: bytes) -> bool:
    try:
        return isinstance(json.loads(b), dict)
    except Exception:
        return False


@settings(max_examples=350, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=bad_field_body())
def test_one_bad_field_is_a_4xx(server, case):
    route, data = case
    r = _post(server, route, data)
    _assert_openai_error(r)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=broken_bytes())
def test_broken_bodies_are_a_400(server, case):
    route, data = case
    r = _post(server, route, data)
    _assert_openai_error(r, 400, 400)


def test_oversize_bodies_are_413_declared_or_streamed(server):
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
    err = _assert_openai_error(_post(server, "/v1/completions", big), 413, 413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: chunked transfer encoding
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'
    r = SESSION.post(server.base + "/v1/completions", data=chunks(),
                     headers={"Content-Type": "application/json", **server.auth}, timeout=60)
    _assert_openai_error(r, 413, 413)


@pytest.mark.parametrize("method,route", [("GET", "/v1/completions"), ("GET", "/nope"),
                                          ("POST", "/v1/models"), ("DELETE", "/health")])
def test_unknown_routes_and_methods_are_openai_errors(server, method, route):
    r = SESSION.request(method, server.base + route, headers=server.auth, timeout=30)
    _assert_openai_error(r)


def test_invalid_requests_name_their_param(server):
    cases = [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/completions", {"prompt": [5, 10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "presence_penalty": 2.5}, "presence_penalty"),
    ]
    for route, body, param in cases:
        err = _assert_openai_error(_post(server, route, json.dumps(body).encode()), 400, 400)
        assert err["param"] == param, (body, err)


def test_server_still_serves_after_the_onslaught(server):
    for route, body in VALID.items():
        r = _post(server, route, json.dumps({**body, "model": server.model}).encode())
        assert r.status_code == 200, (route, r.text)
    r = _post(server, "/v1/completions", json.dumps(
        {"prompt": "Hi", "max_tokens": 3, "stream": True}).encode())
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert SESSION.get(server.base + "/health", timeout=30).status_code == 200
