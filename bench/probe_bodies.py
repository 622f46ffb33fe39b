"""Family 1 of bench/hostile_probe.py: hostile request bodies.

Rows: ``bodies`` (hand-built attacks, each with what it must get: a 4xx in OpenAI's shape, a
2xx, or either) , ``bodies-types`` (every field of both generation routes given every JSON
type: a type the field cannot take must be a 4xx), ``bodies-random`` (random sampling fields
from a fixed seed; a request whose every field is drawn from the valid pool must be a 2xx, one
with a field from the invalid pool a 4xx). Every 2xx is checked: a JSON body with choices, or
a stream that ends in ``[DONE]`` without an error event.
"""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from probe_kit import Answer, Tally, Target, post, request_bytes, exchange, sse_events

C, H, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
MSG = [{"role": "user", "content": "Hi"}]
BASE = {C: {"prompt": "Hello", "max_tokens": 2, "temperature": 0},
        H: {"messages": MSG, "max_tokens": 2, "max_completion_tokens": 2, "temperature": 0},
        TOK: {"prompt": "Hello"}, DETOK: {"tokens": [1, 2, 3]}}
Case = tuple[str, str, bytes, str]  # label, route, body, expectation
#: A refusal (a request over a limit) must come within this: the limits are checked before
#: any work (README: "refused before it runs").
REFUSE_S = 3.0
#: n far over max_n (128) but under the edge's int32 bound: refused at once by a server that
#: checks before it allocates per choice; ``--unsafe`` sends 10**9 and 2**31 - 1 too (which
#: exhaust the memory of a server that allocates first).
HUGE_N = 4_000_000
UNSAFE_N = (10**9, 2**31 - 1)


def _base(route: str, name: str | None = None) -> dict[str, Any]:
    """The valid body of ``route``; on chat, without ``max_completion_tokens`` when the
    probe is of ``max_tokens`` (which it would otherwise override)."""
    body = dict(BASE[route])
    if route == H and name == "max_tokens":
        body.pop("max_completion_tokens")
    return body


def _j(route: str, **fields: Any) -> bytes:
    name = "max_tokens" if "max_tokens" in fields else None
    return json.dumps({**_base(route, name), **fields}).encode()


def _raw_field(route: str, name: str, text: str) -> bytes:
    """The base body with ``name`` set to the raw JSON ``text`` (NaN, 1e400, ...)."""
    body = {k: v for k, v in _base(route, name).items() if k != name}
    head = json.dumps(body).encode()[:-1]
    return head + (b", " if body else b"") + f'"{name}": {text}}}'.encode()


def malformed() -> list[Case]:
    out: list[Case] = []
    bodies = [b"{", b'{"prompt": "x",}', b"{'prompt': 'x'}", b'{"prompt": "x"} junk',
              b'{"prompt": "x"}{"prompt": "y"}', b'{"prompt": "\\x"}', b'{"prompt": "a\x00b"}',
              b'{"prompt": "\xff"}', b'{"prompt": "\xc0\xaf"}', b'{"prompt": "\xed\xa0\x80"}',
              b"", b"   ", b"\n\n", b"null", b"1", b'"x"', b"[]", b'[{"prompt": "x"}]',
              b"true", b"1.5", b'{"prompt": "x", "prompt": 5}', b"\x00" * 64,
              bytes(random.Random(1).randrange(256) for _ in range(256))]
    for route in (C, H, TOK, DETOK):
        out += [(f"malformed {b[:24]!r}", route, b, "4xx") for b in bodies]
        out.append(("utf-8 BOM", route, b"\xef\xbb\xbf" + _j(route), "ok"))
        out.append(("utf-16 body", route, json.dumps(BASE[route]).encode("utf-16"), "ok"))
    return out


def numbers() -> list[Case]:
    out: list[Case] = []
    for route in (C, H):
        for name in ("temperature", "top_p", "min_p", "max_tokens", "seed", "top_k", "n",
                     "presence_penalty", "min_tokens"):
            for text in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9" * 5000,
                         "-" + "9" * 4000):
                out.append((f"{name}={text[:12]}", route, _raw_field(route, name, text), "4xx"))
        for name, v, want in [("max_tokens", 2**31, "4xx"), ("max_tokens", 2**31 - 1, "4xx"),
                              ("max_tokens", 10**12, "4xx"), ("max_tokens", 0, "4xx"),
                              ("max_tokens", -5, "4xx"), ("seed", 2**64, "4xx"),
                              ("seed", 2**64 - 1, "2xx"), ("seed", -1, "ok"),
                              ("seed", -(2**63) - 1, "4xx"), ("top_k", -2, "4xx"),
                              ("top_k", -1, "2xx"), ("n", 0, "4xx"), ("n", 129, "4xx"),
                              ("n", 2**31, "4xx"), ("n", 10**30, "4xx"),
                              ("temperature", 1e308, "2xx"), ("temperature", -0.0, "2xx"),
                              ("temperature", 5e-324, "2xx"), ("top_p", 5e-324, "2xx"),
                              ("min_p", 1.0, "2xx"), ("min_tokens", 3, "4xx"),
                              ("max_tokens", 2.0, "ok"), ("prompt_logprobs", 21, "4xx"),
                              ("prompt_logprobs", 20, "2xx")]:
            out.append((f"{name}={v!r}"[:40], route, _j(route, **{name: v}), want))
        for k in (2048, 10**6, 2**31 - 1):
            out.append((f"top_k={k} above the vocabulary", route, _j(route, top_k=k), "2xx"))
        out.append(("top_k=2**31", route, _j(route, top_k=2**31), "ok"))
        out.append(("top_k=2**63", route, _j(route, top_k=2**63), "ok"))
    out += [("logprobs=21", C, _j(C, logprobs=21), "4xx"),
            ("logprobs=20", C, _j(C, logprobs=20), "2xx"),
            ("logprobs=20 echo prompt_logprobs=20 n=8 stream", C,
             _j(C, logprobs=20, echo=True, prompt_logprobs=20, n=8, stream=True,
                temperature=0.7, seed=3), "2xx"),
            ("n=128 max_tokens=1", C, _j(C, n=128, max_tokens=1), "2xx"),
            ("top_logprobs=21", H, _j(H, logprobs=True, top_logprobs=21), "4xx"),
            ("top_logprobs=20", H, _j(H, logprobs=True, top_logprobs=20), "2xx"),
            ("top_logprobs without logprobs", H, _j(H, top_logprobs=3), "4xx"),
            ("max_tokens past the context", C, _j(C, max_tokens=4096), "4xx"),
            ("max_completion_tokens=0", H, _j(H, max_completion_tokens=0), "4xx")]
    return out


def _deep(d: int, open_: str = "[", close: str = "]") -> str:
    return open_ * d + close * d


def structure() -> list[Case]:
    out: list[Case] = []
    for d in (33, 1000, 100_000):
        out += [(f"prompt nested {d}", C, f'{{"prompt": {_deep(d)}}}'.encode(), "4xx"),
                (f"stream_options nested {d}", C,
                 _raw_field(C, "stream_options", '{"a":' * d + "1" + "}" * d), "4xx"),
                (f"messages nested {d}", H, f'{{"messages": {_deep(d)}}}'.encode(), "4xx")]
    for route, field in ((C, "prompt"), (C, "stop"), (C, "model"), (H, "user"), (TOK, "prompt")):
        out.append((f"lone surrogate in {field}", route,
                    _raw_field(route, field, '"a\\ud800b"'), "4xx"))
    out += [("lone low surrogate in content", H,
             _raw_field(H, "messages", '[{"role": "user", "content": "\\udfff"}]'), "4xx"),
            ("lone surrogate as a key", C, _raw_field(C, "logit_bias", '{"\\ud800": 1}'), "4xx"),
            ("surrogate pair (emoji) prompt", C, _raw_field(C, "prompt", '"\\ud83d\\ude00"'),
             "2xx")]
    for m in ("gpt-4", "", "DEMO", "demo ", "demo\u0000", "x" * 10_000):
        out.append((f"model {m[:12]!r}", C, _j(C, model=m), "4xx"))
        out.append((f"model {m[:12]!r}", H, _j(H, model=m), "4xx"))
    return out


def token_ids(t: Target) -> list[Case]:
    v = t.vocab
    bad = [[-1], [v], [2**31 - 1], [2**31], [2**63], [10**30], [1.5], [True], [[1, 2], [-5]],
           [], [[]], [0] * t.max_len, ["a", 1], [[1, "a"]], [[1]] * 300, None]
    out: list[Case] = [(f"prompt ids {json.dumps(p)[:30]}", C, _j(C, prompt=p), "4xx")
                       for p in bad]
    out += [("prompt ids valid", C, _j(C, prompt=[1, 2, 3]), "2xx"),
            ("prompt ids batch", C, _j(C, prompt=[[1, 2], [3, 4]]), "2xx"),
            ("prompt last id echo logprobs", C,
             _j(C, prompt=[v - 1, 0, v - 1], echo=True, logprobs=2), "ok"),
            ("detokenize [-1]", DETOK, _j(DETOK, tokens=[-1]), "4xx"),
            ("detokenize [10**30]", DETOK, _j(DETOK, tokens=[10**30]), "4xx"),
            ("detokenize the top id", DETOK, _j(DETOK, tokens=[v - 1]), "ok"),
            ("detokenize 100k ids", DETOK, _j(DETOK, tokens=[5] * 100_000), "ok"),
            ("tokenize prompt and messages", TOK, _j(TOK, messages=MSG), "4xx"),
            ("4097 messages", H, _j(H, messages=MSG * 4097), "4xx"),
            ("image part", H, _j(H, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "4xx"),
            ("role wizard", H, _j(H, messages=[{"role": "wizard", "content": "x"}]), "4xx"),
            ("continue a user message", H,
             _j(H, continue_final_message=True, add_generation_prompt=False), "ok")]
    return out


def sizes(t: Target) -> list[Case]:
    v = t.vocab
    many = [f"s{i}" for i in range(5000)]
    return [("prompt of 1 MiB + 1", C, _j(C, prompt="a" * (1 << 20)), "413"),
            ("valid JSON padded to 1 MiB - 64", C,
             b" " * ((1 << 20) - 64 - len(_j(C))) + _j(C), "2xx"),
            ("text prompt of 900 KB", C, _j(C, prompt="word " * 180_000), "4xx"),
            ("257 stop strings", C, _j(C, stop=many[:257]), "4xx"),
            ("5000 stop strings", C, _j(C, stop=many), "4xx"),
            ("256 stop strings", C, _j(C, stop=many[:256]), "2xx"),
            ("256 stop strings of 32 chars", C,
             _j(C, stop=[f"{i:032d}" for i in range(256)]), "2xx"),
            ("one stop string of 8193 chars", C, _j(C, stop=["z" * 8193]), "4xx"),
            ("1000 copies of one stop string", C, _j(C, stop=["e"] * 1000), "ok"),
            ("empty stop string", C, _j(C, stop=[""]), "4xx"),
            ("90k distinct stop strings", C, _j(C, stop=[f"q{i}" for i in range(90_000)]),
             "4xx"),
            ("100k copies of one stop string", C, _j(C, stop=["q"] * 100_000), "ok"),
            ("stop_token_ids [vocab]", C, _j(C, stop_token_ids=[v]), "4xx"),
            ("stop_token_ids [10**6]", C, _j(C, stop_token_ids=[10**6]), "4xx"),
            ("stop_token_ids [2**31]", C, _j(C, stop_token_ids=[2**31]), "4xx"),
            ("stop_token_ids [2**63]", C, _j(C, stop_token_ids=[2**63]), "4xx"),
            ("stop_token_ids [-1]", C, _j(C, stop_token_ids=[-1]), "4xx"),
            ("stop_token_ids the whole vocabulary", C,
             _j(C, stop_token_ids=list(range(v))), "2xx"),
            ("stop_token_ids 5000 out of vocabulary", C,
             _j(C, stop_token_ids=list(range(v, v + 5000))), "4xx"),
            ("stop_token_ids 4097 (duplicates)", C,
             _j(C, stop_token_ids=[i % v for i in range(4097)]), "ok"),
            ("stop_token_ids whole vocabulary, min_tokens 2", C,
             _j(C, stop_token_ids=list(range(v)), min_tokens=2, max_tokens=3), "2xx"),
            ("chat 4096 messages of 1 KB", H,
             _j(H, messages=[{"role": "user", "content": "w" * 200}] * 4096), "4xx")]


# --------------------------------------------------------------------------- field types

COMMON = {"model": "str?", "max_tokens": "int?", "temperature": "num?", "top_p": "num?",
          "top_k": "int?", "min_p": "num?", "seed": "int?", "n": "int", "stop": "stop",
          "stop_token_ids": "ints?", "ignore_eos": "bool", "min_tokens": "int",
          "prompt_logprobs": "int?", "stream": "bool", "stream_options": "obj?", "user": "str?",
          "skip_special_tokens": "bool", "include_stop_str_in_output": "bool", "echo": "bool",
          "return_token_ids": "bool", "presence_penalty": "num?", "frequency_penalty": "num?",
          "repetition_penalty": "num?", "logit_bias": "obj?"}
ONLY = {C: {"prompt": "prompt", "logprobs": "int?", "suffix": "str?", "best_of": "int?"},
        H: {"messages": "messages", "logprobs": "bool", "top_logprobs": "int?",
            "max_completion_tokens": "int?", "add_generation_prompt": "bool",
            "continue_final_message": "bool", "tools": "list?", "tool_choice": "choice?",
            "response_format": "obj?"}}
WRONG = [True, 7, 2.5, "x", [], {}, [1, "a"], {"a": 1}, None, -1, [[1]], ["s"]]
QUICK_WRONG = [True, 2.5, "x", {}, None, [1, "a"]]


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def type_ok(tag: str, v: Any) -> bool:
    """Whether a strict OpenAI-shaped model could take ``v`` for a field of type ``tag``."""
    if tag.endswith("?") and v is None:
        return True
    base = tag.rstrip("?")
    return {
        "str": lambda: isinstance(v, str), "int": lambda: _is_int(v),
        "num": lambda: _is_int(v) or isinstance(v, float), "bool": lambda: isinstance(v, bool),
        "stop": lambda: v is None or isinstance(v, str) or (
            isinstance(v, list) and all(isinstance(s, str) for s in v)),
        "ints": lambda: isinstance(v, list) and all(_is_int(x) for x in v),
        "obj": lambda: isinstance(v, dict), "list": lambda: isinstance(v, list),
        "choice": lambda: isinstance(v, (str, dict)),
        "prompt": lambda: isinstance(v, str) or (isinstance(v, list) and (
            all(isinstance(x, str) for x in v) or all(_is_int(x) for x in v)
            or all(isinstance(x, list) and all(_is_int(y) for y in x) for x in v))),
        "messages": lambda: isinstance(v, list) and all(isinstance(m, dict) for m in v),
    }[base]()


def field_types(quick: bool) -> list[Case]:
    out: list[Case] = []
    for route in (C, H):
        for name, tag in {**COMMON, **ONLY[route]}.items():
            for v in (QUICK_WRONG if quick else WRONG):
                if name == "stream_options" and isinstance(v, dict):
                    body = _j(route, stream=True, stream_options=v)
                else:
                    body = _j(route, **{name: v})
                out.append((f"{name}={json.dumps(v)}", route, body,
                            "ok" if type_ok(tag, v) else "4xx"))
    return out


# --------------------------------------------------------------------------- random fields

NAN, INF = float("nan"), float("inf")
VALID = {"temperature": [0, 0.0, 0.5, 1.0, 1e-6, 2.0, 100.0],
         "top_p": [1.0, 0.5, 1e-9, 0.999], "top_k": [-1, 0, 1, 5, 2047, 2048, 10**6, 2**31 - 1],
         "min_p": [0.0, 0.1, 0.999, 1.0], "seed": [None, 0, 1, 2**63, 2**64 - 1],
         "n": [1, 2, 3], "max_tokens": [1, 2, 5], "min_tokens": [0, 1],
         "stop": [None, "e", ["a", "the"], ["x", "x", "x"]],
         "stop_token_ids": [None, [], [0], [5, 7], [2047]], "ignore_eos": [True, False],
         "logprobs": [None, 0, 1, 20], "prompt_logprobs": [None, 0, 5],
         "skip_special_tokens": [True, False], "include_stop_str_in_output": [True, False],
         "echo": [False, True], "stream": [False, True]}
INVALID = {"temperature": [-0.1, -1e300, NAN, INF, "0.5", True, []],
           "top_p": [0, 0.0, -0.5, 1.0001, NAN, INF, "1"], "top_k": [-2, -(2**40), 1.5, "5"],
           "min_p": [-0.01, 1.01, NAN, -INF], "seed": [2**64, -(2**63) - 1, 1.5, "7"],
           "n": [0, -1, 129, 2**40, 1.0], "max_tokens": [0, -1, 2**31, 1.5],
           "min_tokens": [-1, 1.5, 6], "stop": [[""], 5, [1], {"a": "b"}],
           "stop_token_ids": [[-1], [2048], [2**31], [1.5], "5"], "ignore_eos": [1, "true"],
           "logprobs": [-1, 21, 2**40, 1.5], "prompt_logprobs": [-1, 21, True],
           "skip_special_tokens": [0, None], "include_stop_str_in_output": ["no"],
           "echo": [1], "stream": ["yes", 0]}


def random_body(rng: random.Random, vocab: int) -> tuple[str, bytes, str]:
    """(route, body, expectation) of one random request: a few fields, maybe one invalid."""
    body: dict[str, Any] = {"prompt": rng.choice(["Hello", "The experts", [1, 2, 3],
                                                  [[4, 5], [6]], "x" * 40])}
    names = rng.sample(sorted(VALID), rng.randrange(1, 8))
    bad = rng.random() < 0.4
    for name in names:
        body[name] = rng.choice(VALID[name])
    if bad:
        name = rng.choice(sorted(INVALID))
        body[name] = rng.choice(INVALID[name])
    body.setdefault("max_tokens", 4)  # chat without it would run to the context's end
    if not bad and body.get("min_tokens", 0) > body["max_tokens"]:
        body["min_tokens"] = 0
    route = C
    if rng.random() < 0.3 and not bad:  # chat: logprobs is a bool there
        route, lp = H, body.pop("logprobs", None)
        body.pop("prompt")
        body.pop("echo", None)
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Tell me"])}]
        if lp is not None:
            body.update(logprobs=True, top_logprobs=lp)
    return route, json.dumps(body).encode(), "4xx" if bad else "2xx"


# --------------------------------------------------------------------------- running

def check_success(tally: Tally, row: str, ans: Answer, route: str, body: bytes,
                  repro: str) -> None:
    """A 2xx must be a whole answer: choices, or a stream ending in [DONE] with no error."""
    if ans.kind != "http" or not 200 <= (ans.status or 0) < 300:
        return
    if route in (TOK, DETOK):
        if not isinstance(ans.json(), dict):
            tally.mismatch(row, "200 that is not a JSON object", repro, ans.short())
    elif b'"stream": true' in body:
        events = sse_events(ans.body)
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if errors or not events or events[-1] != "[DONE]":
            tally.mismatch(row, "200 stream with an error event or no [DONE]", repro,
                           f"{errors[:1]} last={events[-1:] if events else None}")
    elif not isinstance(ans.json(), dict) or not ans.json().get("choices"):
        tally.mismatch(row, "200 without choices", repro, ans.short())


def fire(tally: Tally, t: Target, row: str, cases: list[Case], workers: int = 4,
         deadline_s: float = 90.0) -> None:
    def one(case: Case) -> None:
        label, route, body, expect = case
        repro = f"POST {route} {label}: {body[:200]!r}{' ...' if len(body) > 200 else ''}"
        ans = post(t, route, body, deadline_s)
        tally.record(row, ans, expect, repro)
        check_success(tally, row, ans, route, body, repro)
        if expect == "4xx" and ans.kind == "http" and ans.elapsed > REFUSE_S:
            tally.mismatch(row, f"refused only after {REFUSE_S:g}+ s (work before the limit "
                           f"check)", repro, f"{ans.short(120)} after {ans.elapsed:.1f}s")

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, cases))


def chunked_oversize(tally: Tally, t: Target) -> None:
    """A body over the limit in chunks (no Content-Length), and a Content-Length that lies."""
    head = request_bytes("POST", C, None, {**t.auth, "Content-Type": "application/json",
                                           "Transfer-Encoding": "chunked"})
    chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    ans = exchange(t, [(head, 0.0)] + [(chunk, 0.0)] * 18 + [(b"0\r\n\r\n", 0.0)], 30.0)
    tally.record("bodies", ans, "413", "POST /v1/completions chunked, 18 x 64 KiB, no length")
    for n in (10**12, 2**70):
        lie = request_bytes("POST", C, b"{}", {**t.auth, "Content-Type": "application/json",
                                               "Content-Length": str(n)})
        ans = exchange(t, lie, 30.0)
        tally.record("bodies", ans, "4xx", f"POST /v1/completions Content-Length: {n}, 2 bytes")


def huge_n(tally: Tally, t: Target, values: tuple[int, ...]) -> None:
    """n far over max_n, alone on the server: refused within REFUSE_S, and /health (polled
    meanwhile) still answering within a second."""
    from probe_kit import get

    for n in values:
        for route in (C, H):
            lat: list[float] = []
            done = threading.Event()

            def poll() -> None:
                while not done.is_set():
                    lat.append(get(t, "/health", 30.0, key=False).elapsed)
                    time.sleep(0.2)

            th = threading.Thread(target=poll, daemon=True)
            th.start()
            body, repro = _j(route, n=n), f"POST {route} {{..., \"n\": {n}}} (max_n is 128)"
            ans = post(t, route, body, 120.0)
            done.set()
            th.join(35)
            tally.record("bodies", ans, "4xx", repro)
            if ans.kind == "http" and ans.elapsed > REFUSE_S:
                tally.mismatch("bodies", "huge n refused only after seconds (work per choice "
                               "before the max_n check)", repro,
                               f"{ans.short(100)} after {ans.elapsed:.1f}s")
            if lat and max(lat) > 1.0:
                tally.mismatch("bodies", "one request stalled /health", repro,
                               f"/health took {max(lat):.1f}s meanwhile")


def run(tally: Tally, t: Target, quick: bool, unsafe: bool = False) -> None:
    hand = malformed() + numbers() + structure() + token_ids(t) + sizes(t)
    if quick:
        hand = hand[::3]
    fire(tally, t, "bodies", hand)
    huge_n(tally, t, (HUGE_N, *UNSAFE_N) if unsafe else (HUGE_N,))
    chunked_oversize(tally, t)
    fire(tally, t, "bodies-types", field_types(quick))
    rng = random.Random(14)
    fire(tally, t, "bodies-random",
         [("random", *random_body(rng, t.vocab)) for _ in range(60 if quick else 300)])
