"""Nothing a client sends is accepted and ignored: an unknown field is a 400 naming it (and a
chat-only field sent to /tokenize with a prompt); vLLM's ``use_beam_search`` (refused when true,
on both routes), ``truncate_prompt_tokens``, ``stream_options.continuous_usage_stats``,
``return_token_ids`` and ``usage.prompt_tokens_details.cached_tokens`` do what vLLM's server
does."""

from __future__ import annotations

import openai
import pytest

CHAT = [{"role": "user", "content": "Hi"}]
IDS = [(7 * i) % 200 + 5 for i in range(40)]


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value


@pytest.mark.parametrize("field, value", [("guided_json", {"type": "object"}),
                                          ("best_of_n_typo", 2), ("functions", [])])
def test_an_unknown_field_is_a_400_naming_it(server, client, field, value):
    err = _refused(client.completions.create, model=server.model, prompt="Hi", max_tokens=2,
                   extra_body={field: value})
    assert err.param == field and "does not support" in err.message, err.body
    err = _refused(client.chat.completions.create, model=server.model, messages=CHAT,
                   max_tokens=2, extra_body={field: value})
    assert err.param == field, err.body


def test_an_unknown_field_in_a_message_is_refused(server, client):
    msgs = [{"role": "assistant", "content": "", "thinking": "hmm"}] + CHAT
    err = _refused(client.chat.completions.create, model=server.model, messages=msgs,
                   max_tokens=2)
    assert err.param == "messages" and "thinking" in err.message, err.body


def test_beam_search_is_refused_not_ignored(server, client):
    for call, kw in ((client.completions.create, {"prompt": "Hi"}),
                     (client.chat.completions.create, {"messages": CHAT})):
        for stream in (False, True):
            err = _refused(call, model=server.model, max_tokens=2, stream=stream,
                           extra_body={"use_beam_search": True}, **kw)
            assert err.param == "use_beam_search" and "beam search" in err.message, err.body
    out = client.completions.create(model=server.model, prompt="Hi", max_tokens=2,
                                    extra_body={"use_beam_search": False})
    assert out.choices[0].text is not None
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2,
                                          extra_body={"use_beam_search": False})
    assert chat.choices[0].message.content is not None


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, client):
    greedy = dict(model=server.model, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    cut = client.completions.create(prompt=IDS, **{**greedy, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": 8}})
    tail = client.completions.create(prompt=IDS[-8:], **greedy)
    assert cut.usage.prompt_tokens == 8
    assert cut.choices[0].text == tail.choices[0].text
    whole = client.completions.create(prompt=IDS, **{**greedy, "extra_body": {
        "ignore_eos": True, "truncate_prompt_tokens": -1}})  # the context length: no cut
    assert whole.usage.prompt_tokens == len(IDS)
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 3})
    assert chat.usage.prompt_tokens == 3
    err = _refused(client.completions.create, model=server.model, prompt=IDS, max_tokens=2,
                   extra_body={"truncate_prompt_tokens": 0})
    assert err.param == "truncate_prompt_tokens", err.body


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_continuous_usage_stats_puts_usage_in_every_chunk(server, client, route):
    kw = dict(model=server.model, max_tokens=5, temperature=0, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True},
              extra_body={"ignore_eos": True})
    if route == "chat":
        chunks = list(client.chat.completions.create(messages=CHAT, **kw))
    else:
        chunks = list(client.completions.create(prompt=IDS[:6], **kw))
    assert chunks and all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done == sorted(done) and done[-1] == 5
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    # without include_usage there is no usage at all, as in vLLM
    plain = dict(kw, stream_options={"continuous_usage_stats": True})
    chunks = list(client.completions.create(prompt=IDS[:6], **plain)) if route != "chat" \
        else list(client.chat.completions.create(messages=CHAT, **plain))
    assert all(c.usage is None for c in chunks)


def _post(server, route: str, body: dict) -> dict:
    import requests

    r = requests.post(f"{server.v1}/{route}", json={"model": server.model, **body},
                      headers=server.auth, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_response_shapes_are_vllms(server):
    """prompt_logprobs is null when not asked for (on the completion choice, at the top of a
    chat response); chat's prompt_token_ids sit at the top; usage says the cached tokens."""
    cmpl = _post(server, "completions", {"prompt": IDS[:5], "max_tokens": 2})
    assert "prompt_logprobs" in cmpl["choices"][0] and cmpl["choices"][0]["prompt_logprobs"] is None
    chat = _post(server, "chat/completions", {"messages": CHAT, "max_tokens": 2,
                                              "return_token_ids": True})
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None
    assert chat["prompt_token_ids"] and "prompt_token_ids" not in chat["choices"][0]
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    assert chat["usage"]["prompt_tokens"] == len(chat["prompt_token_ids"])


def test_a_streamed_chat_opens_with_the_prompt_token_ids(server, client):
    """vLLM's ``return_token_ids`` streamed: the prompt's ids at the top of the opening chunk
    (once), each later chunk's new token ids in its choice."""
    kw = dict(model=server.model, messages=CHAT, max_tokens=4, temperature=0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])
    assert all("prompt_token_ids" not in (ch.model_extra or {})
               for c in chunks for ch in c.choices)
    ids = [t for c in chunks[1:] for ch in c.choices
           for t in ch.model_extra.get("token_ids", [])]
    assert ids == whole.choices[0].model_extra["token_ids"] and len(ids) == 4


def test_cached_tokens_come_from_the_prefix_cache(server, client):
    long = [(11 * i) % 300 + 7 for i in range(80)]  # five full 16-token blocks and more
    first = client.completions.create(model=server.model, prompt=long, max_tokens=2)
    again = client.completions.create(model=server.model, prompt=long, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # whole blocks, last recomputed


def test_cached_tokens_on_chat_whole_and_streamed(server, client):
    # a first word no other test sends: the first block, and so every block, is new
    msgs = [{"role": "user", "content": "Quokkas " + " ".join(f"w{i}" for i in range(60))}]
    kw = dict(model=server.model, messages=msgs, max_tokens=2)
    first = client.chat.completions.create(**kw)
    assert first.usage.prompt_tokens >= 80
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.prompt_tokens == first.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 64
    cont = list(client.chat.completions.create(**kw, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}))
    assert cont[-1].usage.prompt_tokens_details.cached_tokens >= 64


def test_return_tokens_as_token_ids_names_tokens_by_id(server):
    body = {"prompt": IDS[:5], "max_tokens": 3, "logprobs": 2, "temperature": 0,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    out = _post(server, "completions", body)["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    assert all(k.startswith("token_id:") for top in out["logprobs"]["top_logprobs"] for k in top)
    chat = _post(server, "chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True,
                                              "top_logprobs": 2, "return_token_ids": True,
                                              "return_tokens_as_token_ids": True})["choices"][0]
    got = [e["token"] for e in chat["logprobs"]["content"]]
    assert got == [f"token_id:{t}" for t in chat["token_ids"]]
    plain = _post(server, "completions", {**body, "return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in plain["choices"][0]["logprobs"]["tokens"])


def test_tokenize_honours_the_chat_options_and_returns_token_strings(server):
    msgs = CHAT + [{"role": "assistant", "content": "Hello the"}]
    cont = _post_root(server, "tokenize", {"messages": msgs, "add_generation_prompt": False,
                                          "continue_final_message": True})
    closed = _post_root(server, "tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert cont["tokens"] != closed["tokens"]  # the last message is left open, not closed
    chat = _post(server, "chat/completions", {
        "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
        "max_tokens": 1, "return_token_ids": True})
    assert chat["prompt_token_ids"] == cont["tokens"]  # the same rendering as generation uses
    strs = _post_root(server, "tokenize", {"prompt": "Hello the world",
                                           "return_token_strs": True})
    assert len(strs["token_strs"]) == strs["count"] and all(strs["token_strs"])
    assert _post_root(server, "tokenize", {"prompt": "Hi"})["token_strs"] is None
    import requests

    r = requests.post(f"{server.base}/tokenize", headers=server.auth, timeout=30,
                      json={"model": server.model, "messages": msgs,
                            "continue_final_message": True})  # with add_generation_prompt
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize("field, value", [
    ("add_generation_prompt", True), ("add_generation_prompt", False),
    ("continue_final_message", True), ("chat_template_kwargs", {"enable_thinking": False}),
    ("tools", [{"type": "function", "function": {"name": "f"}}])])
def test_tokenize_refuses_chat_fields_with_a_prompt(server, field, value):
    """They shape the chat template's rendering, which a prompt never goes through: a 400
    naming the field, not a field accepted and ignored (the same fields with messages are
    served: test_tokenize_honours_the_chat_options_and_returns_token_strings)."""
    import requests

    r = requests.post(f"{server.base}/tokenize", headers=server.auth, timeout=30,
                      json={"model": server.model, "prompt": "Hi", field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and "messages" in err["message"]
    plain = _post_root(server, "tokenize", {"prompt": "Hi", "tools": None})  # null: left out
    assert plain["count"] == len(plain["tokens"]) > 0


def _post_root(server, route: str, body: dict) -> dict:
    import requests

    r = requests.post(f"{server.base}/{route}", json={"model": server.model, **body},
                      headers=server.auth, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_stop_token_id_outside_the_vocabulary_is_a_400_naming_it(server, client,
                                                                   demo_model_dir):
    import json

    vocab = json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]
    for call, kw in ((client.completions.create, {"prompt": "Hi"}),
                     (client.chat.completions.create, {"messages": CHAT})):
        out = call(model=server.model, max_tokens=2, extra_body={"stop_token_ids": [vocab - 1]},
                   **kw)  # the last id of the vocabulary is one
        assert out.usage.completion_tokens >= 1
        for bad in (vocab, vocab + 5):
            err = _refused(call, model=server.model, max_tokens=2,
                           extra_body={"stop_token_ids": [3, bad]}, **kw)
            assert err.param == "stop_token_ids" and str(bad) in err.message, err.body


def test_a_custom_role_reaches_the_chat_template(server):
    """vLLM passes any role name to the template; the demo template renders it."""
    body = {"messages": [{"role": "narrator", "content": "Once"}] + CHAT}
    with_role = _post_root(server, "tokenize", body)
    plain = _post_root(server, "tokenize", {"messages": CHAT})
    assert with_role["count"] > plain["count"]
    out = _post(server, "chat/completions", {**body, "max_tokens": 2})
    assert out["usage"]["prompt_tokens"] == with_role["count"]
