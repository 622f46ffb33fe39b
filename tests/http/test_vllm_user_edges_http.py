"""What a vLLM user sees at the edges a black-box probe found (raw HTTP, as a client without
the openai SDK's help sees it): content parts the server does not serve refused saying so,
``truncate_prompt_tokens`` over the context refused in vLLM's words, ``"max_tokens": null`` on
/v1/completions running to the context length, streamed tool calls with one entry per
``index`` in a chunk, and a forced tool call cut short by ``max_tokens`` (one shape, streamed or
not). Uses the session's demo and scripted servers (conftest), starts none."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from scripted_model import REASONING, WEATHER_ARGS

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
NOT_SERVED = "are not supported by this server (no vision or audio input); only 'text' parts"
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"type": "string"}}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _post(server, path: str, body: dict, **kw) -> requests.Response:
    return requests.post(f"{server.base}{path}", headers=server.auth,
                         json={"model": server.model, **body}, timeout=120, **kw)


def _error(r: requests.Response) -> dict:
    assert r.status_code == 400, (r.status_code, r.text)
    return r.json()["error"]


def _max_model_len(server) -> int:
    r = requests.get(f"{server.v1}/models", headers=server.auth, timeout=30)
    return r.json()["data"][0]["max_model_len"]


# ---------------------------------------------------------------- chat content parts


@pytest.mark.parametrize("content, said", [
    ([{"type": "text", "text": "hi"}, IMAGE], f"content parts of type 'image_url' {NOT_SERVED}"),
    ([AUDIO], f"content parts of type 'input_audio' {NOT_SERVED}"),
    ([{"type": "video_url", "video_url": {"url": "x"}}], "type 'video_url' are not supported"),
    ([{"type": "text"}], "part 0 of type 'text' is missing its 'text' field"),
    ([{"type": "text", "text": "a"}, {"text": "b"}], "part 1 has no 'type'"),
    ([{"type": "text", "text": 5}], "part 0: 'text' must be a string, not a number"),
    (["hi"], "part 0 must be a content part (an object with a 'type'), not a string"),
    (5, "must be a string, a list of content parts or null, not a number"),
    ({"type": "text", "text": "hi"}, "must be a string, a list of content parts or null, "
                                     "not an object"),
])
def test_content_the_server_does_not_serve_is_a_400_saying_what(server, content, said):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    for path in ("/v1/chat/completions", "/tokenize"):
        err = _error(_post(server, path, {"messages": messages, "max_tokens": 2}
                           if path != "/tokenize" else {"messages": messages}))
        assert err["message"].startswith("messages.1.content: ") and said in err["message"], err
        assert err["param"] == "messages" and err["type"] == "invalid_request_error", err
        assert "Input should be" not in err["message"]  # no pydantic union noise


def test_text_parts_are_served_joined(server):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    whole = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hello\nthere"}]})
    split = _post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    assert split.status_code == 200 and split.json()["tokens"] == whole.json()["tokens"]


# ---------------------------------------------------------------- truncate_prompt_tokens


def test_truncate_prompt_tokens_over_max_model_len_is_refused_in_vllms_words(server):
    limit = _max_model_len(server)
    want = (f"truncate_prompt_tokens value ({limit + 1}) is greater than max_model_len "
            f"({limit}). Please, select a smaller truncation size.")
    for path, body in (("/v1/completions", {"prompt": "a b c"}),
                       ("/v1/chat/completions", {"messages": ASK})):
        err = _error(_post(server, path, {**body, "max_tokens": 2,
                                          "truncate_prompt_tokens": limit + 1}))
        assert err["message"] == want and err["param"] == "truncate_prompt_tokens", err
        ok = _post(server, path, {**body, "max_tokens": 2, "truncate_prompt_tokens": limit})
        assert ok.status_code == 200, ok.text  # the context length itself is allowed


# ---------------------------------------------------------------- max_tokens null


def test_completions_max_tokens_null_runs_to_the_context_length(server):
    limit = _max_model_len(server)
    base = {"temperature": 0, "ignore_eos": True}
    # one long prompt for both routes (the second reads the first's cached prefix): a chat
    # conversation's last limit - 3 tokens, as truncate_prompt_tokens keeps them
    chat_body = {"messages": [{"role": "user", "content": "a " * (limit + 50)}],
                 "truncate_prompt_tokens": limit - 3}
    ids = _post(server, "/tokenize", {"messages": chat_body["messages"]}).json()["tokens"]
    prompt = ids[-(limit - 3):]
    out = _post(server, "/v1/completions", {**base, "prompt": prompt, "max_tokens": None})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["usage"]["completion_tokens"] == 3, body["usage"]  # max_model_len - prompt
    assert body["choices"][0]["finish_reason"] == "length"
    left_out = _post(server, "/v1/completions", {**base, "prompt": prompt[:8]}).json()
    assert left_out["usage"]["completion_tokens"] == 16  # the field's default, as vLLM's
    # chat has no such default: left out (as null), it runs to the context length too
    chat = _post(server, "/v1/chat/completions", {**base, **chat_body})
    assert chat.status_code == 200, chat.text
    usage = chat.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (limit - 3, 3), usage


# ---------------------------------------------------------------- streamed tool calls


def _raw_chunks(server, body: dict, path: str = "/v1/chat/completions") -> list[dict]:
    with _post(server, path, {**body, "stream": True}, stream=True) as r:
        assert r.status_code == 200, r.text
        lines = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("trigger, extra, names", [
    (None, {}, ["get_weather"]),                                 # after thinking
    ("[[two]]", {}, ["get_weather", "get_time"]),                # tags split over tokens
    ("[[two]]", {"parallel_tool_calls": False}, ["get_weather"]),
    (None, {"tool_choice": "required"}, None),                   # forced, structured output
    (None, {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     ["get_time"]),
])
def test_a_streamed_chunk_has_one_tool_call_entry_per_index(scripted_server, trigger, extra,
                                                            names):
    # greedy: a forced call's grammar masks the script's tokens, and a sampled walk through
    # what it allows may not finish a call's name within max_tokens (then no call: its text)
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 64, "temperature": 0, **extra}
    if trigger is not None:
        body.update(messages=ASK + [{"role": "assistant", "content": trigger}],
                    add_generation_prompt=False, continue_final_message=True)
    calls: dict[int, list] = {}
    for chunk in _raw_chunks(scripted_server, body):
        for choice in chunk["choices"]:
            entries = choice["delta"].get("tool_calls") or []
            indices = [e["index"] for e in entries]
            assert len(indices) == len(set(indices)), entries  # as OpenAI and vLLM send them
            for e in entries:
                if e["index"] not in calls:  # a call opens with its id, type and name
                    assert e["id"].startswith("chatcmpl-tool-") and e["type"] == "function", e
                    calls[e["index"]] = [e["function"]["name"], ""]
                else:
                    assert "id" not in e and "name" not in e["function"], e
                calls[e["index"]][1] += e["function"].get("arguments") or ""
    got = [calls[i] for i in sorted(calls)]
    assert got, calls
    if "tool_choice" not in extra:  # a forced call's grammar may be cut by max_tokens
        assert all(isinstance(json.loads(args), dict) for _, args in got), got
    if names is not None:
        assert [name for name, _ in got] == names, got
    if trigger is None and not extra:
        assert got == [["get_weather", WEATHER_ARGS]]


# ---------------------------------------------------------------- sampling penalties

PENALTIES = {"presence_penalty": 1.2, "frequency_penalty": 0.8, "repetition_penalty": 1.5}


def test_penalties_are_served_as_the_offline_engine_serves_them(server, client, offline_llm):
    """The openai client's presence/frequency_penalty and vLLM's repetition_penalty reach the
    engine: the text equals the offline LLM's with the same penalties (and differs from the
    unpenalized text, so the penalties did something)."""
    from epserve import SamplingParams

    prompt = "the the the the the the"
    kw = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = offline_llm.generate(prompt, SamplingParams(**kw, **PENALTIES))[0].outputs[0].text
    plain = offline_llm.generate(prompt, SamplingParams(**kw))[0].outputs[0].text
    assert want != plain
    got = client.completions.create(
        model=server.model, prompt=prompt, temperature=0.0, max_tokens=24,
        presence_penalty=PENALTIES["presence_penalty"],
        frequency_penalty=PENALTIES["frequency_penalty"],
        extra_body={"repetition_penalty": PENALTIES["repetition_penalty"], "ignore_eos": True})
    assert got.choices[0].text == want
    chat = _post(server, "/v1/chat/completions", {
        "messages": ASK, "max_tokens": 8, "temperature": 0, **PENALTIES})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize("field,value", [("presence_penalty", 3), ("frequency_penalty", -2.5),
                                         ("repetition_penalty", 0)])
def test_a_penalty_out_of_range_is_a_400_naming_it(server, field, value):
    err = _error(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                                   field: value}))
    assert err["param"] == field and field in err["message"], err


# ---------------------------------------------------------------- forced calls cut short

GET_TIME = {"type": "function", "function": {"name": "get_time"}}


def _streamed_choice(server, body: dict) -> tuple[str, list[list[str]], str | None]:
    """(content, calls as [name, arguments], finish_reason) of a streamed single choice."""
    content, calls, finish = "", {}, None
    for chunk in _raw_chunks(server, body):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for e in delta.get("tool_calls") or []:
                call = calls.setdefault(e["index"], [e["function"].get("name"), ""])
                call[1] += e["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice, max_tokens", [
    ("required", 4),    # cut before the call's name is complete: the text is the content
    ("required", 48),   # cut inside the arguments: the call as far as it got
    (GET_TIME, 4),      # a named function's call opens with the first token
])
def test_a_forced_call_cut_by_max_tokens_is_length_with_its_text(scripted_server, choice,
                                                                   max_tokens):
    """One shape, streamed or not: finish_reason 'length', the calls as far as they got, and
    the text no call could hold as content; every generated character is in the answer."""
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": max_tokens,
            "seed": 11}
    r = _post(scripted_server, "/v1/chat/completions", {**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    assert whole["finish_reason"] == "length" and len(whole["token_ids"]) == max_tokens
    text = _post(scripted_server, "/detokenize", {"tokens": whole["token_ids"]}).json()["prompt"]
    msg = whole["message"]
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in msg["tool_calls"]]
    if choice == "required" and max_tokens == 4:
        assert calls == [] and msg["content"] == text and text.strip(), (msg, text)
    else:
        assert msg["content"] == "" and calls, msg
        name, args = calls[-1]
        assert name in ("get_weather", "get_time") and text.endswith(args), (calls, text)
        with pytest.raises(ValueError):
            json.loads(args)  # cut: not valid JSON, and finish_reason says so
        if choice is GET_TIME:
            assert calls == [["get_time", text]]
    # streamed with the same seed: the same content, calls and finish_reason
    assert _streamed_choice(scripted_server, body) == (msg["content"], calls, "length")


# ---------------------------------------------------------------- vLLM's request extras


def test_include_reasoning_false_leaves_the_reasoning_out(scripted_server):
    """vLLM's include_reasoning: false drops reasoning_content / reasoning from the message and
    from every streamed delta; the content (and a call after the thinking) stays as it was."""
    body = {"messages": ASK, "max_tokens": 64}
    kept = _post(scripted_server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert kept["reasoning_content"] == kept["reasoning"] == REASONING  # the default: true
    off = {**body, "include_reasoning": False}
    msg = _post(scripted_server, "/v1/chat/completions", off).json()["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["reasoning"] is None, msg
    assert msg["content"] == kept["content"] and "think>" not in msg["content"]
    deltas = [c["delta"] for ch in _raw_chunks(scripted_server, off) for c in ch["choices"]]
    assert not any("reasoning_content" in d or "reasoning" in d for d in deltas), deltas
    assert "".join(d.get("content") or "" for d in deltas) == kept["content"]
    with_tools = _post(scripted_server, "/v1/chat/completions", {**off, "tools": TOOLS})
    (choice,) = with_tools.json()["choices"]
    assert choice["message"]["reasoning_content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]] == [("get_weather", WEATHER_ARGS)]


def test_request_id_is_the_response_id(server):
    """vLLM's request_id: the response (and every chunk) is '<cmpl|chatcmpl>-<request_id>';
    two requests sent at once with one id are both served (the engine's ids stay unique)."""
    for path, body, prefix in (("/v1/chat/completions", {"messages": ASK}, "chatcmpl"),
                               ("/v1/completions", {"prompt": "hi"}, "cmpl")):
        body = {**body, "max_tokens": 2, "request_id": "trace-42"}
        r = _post(server, path, body)
        assert r.status_code == 200 and r.json()["id"] == f"{prefix}-trace-42", r.text
        assert {c["id"] for c in _raw_chunks(server, body, path)} == {f"{prefix}-trace-42"}
    same = {"messages": ASK, "max_tokens": 24, "ignore_eos": True, "request_id": "same"}
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: _post(server, "/v1/chat/completions", same), range(3)))
    for r in answers:
        assert r.status_code == 200 and r.json()["id"] == "chatcmpl-same", r.text
        assert r.json()["usage"]["completion_tokens"] == 24
    err = _error(_post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2,
                                                        "request_id": "a\nb"}))
    assert err["param"] == "request_id", err


def test_priority_is_served_at_0_and_refused_otherwise_in_vllms_words(server):
    """vLLM's priority under its default first-come-first-served policy: 0 is served, any
    other value is a 400 in vLLM's words (this server schedules first-come-first-served)."""
    for path, body in (("/v1/chat/completions", {"messages": ASK}),
                       ("/v1/completions", {"prompt": "hi"})):
        ok = _post(server, path, {**body, "max_tokens": 2, "priority": 0})
        assert ok.status_code == 200, ok.text
        for value in (5, -1):
            err = _error(_post(server, path, {**body, "max_tokens": 2, "priority": value}))
            assert err["message"] == (f"Got priority {value} but Priority scheduling is not "
                                      f"enabled.") and err["param"] == "priority", err


def test_add_special_tokens_is_served_on_chat_completions_and_tokenize(server):
    """vLLM's add_special_tokens: chat's default false (the template wrote them), true for a
    completion's text prompt; chat's value reaches the tokenizer as /tokenize's does (the demo
    tokenizer adds none, so the counts agree either way; the next test shows the value used)."""
    msgs = {"messages": ASK}
    for flag in (True, False):
        count = _post(server, "/tokenize", {**msgs, "add_special_tokens": flag}).json()["count"]
        r = _post(server, "/v1/chat/completions", {**msgs, "max_tokens": 2,
                                                   "add_special_tokens": flag})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == count, r.text
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2,
                                              "add_special_tokens": flag})
        assert r.status_code == 200, r.text


BOS = 99_999  # no id of the demo vocabulary


class _BosTokenizer:
    """The demo tokenizer, with a BOS token that encode adds as a Llama-style one does."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text, add_special_tokens=True):
        return [BOS] * add_special_tokens + self._tok.encode(text, add_special_tokens=False)


def test_add_special_tokens_decides_whether_the_rendered_chat_gets_a_bos(demo_model_dir):
    """The serving path itself (no engine): the rendered chat is encoded with the request's
    add_special_tokens (default false), /tokenize's messages too (default false), its prompt
    with true by default."""
    from transformers import AutoTokenizer

    from epserve.deploy.openai_models import ChatCompletionRequest, validate
    from epserve.deploy.serving import ModelInfo, OpenAIServing
    from epserve.head.limits import RequestLimits

    tok = _BosTokenizer(AutoTokenizer.from_pretrained(str(demo_model_dir)))
    serving = OpenAIServing(None, tok, ModelInfo("demo", "", 4096, len(tok._tok),
                                                 RequestLimits()), metrics=None)

    def chat_ids(**kw):
        req = validate(ChatCompletionRequest, {"messages": ASK, **kw})
        return asyncio.run(serving.render_chat(req)).ids

    def tokenized(**kw):
        return asyncio.run(serving.tokenize(kw))["tokens"]

    plain = chat_ids()
    assert BOS not in plain and chat_ids(add_special_tokens=True) == [BOS] + plain
    assert chat_ids(add_special_tokens=False) == plain
    assert tokenized(messages=ASK) == plain
    assert tokenized(messages=ASK, add_special_tokens=True) == [BOS] + plain
    assert tokenized(prompt="hi")[0] == BOS
    assert BOS not in tokenized(prompt="hi", add_special_tokens=False)
