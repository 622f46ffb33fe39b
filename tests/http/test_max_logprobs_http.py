"""``--max-logprobs -1`` (vLLM's: the vocabulary size) with the openai client, on the scripted
server (conftest), which runs with it: a request may ask for every token's logprob (far above
the default 20) on completions and chat, or all of them with vLLM's ``-1``, and one more than
the vocabulary is a 400 naming the field and the bound."""

from __future__ import annotations

import re

import openai
import pytest


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value


def test_every_token_of_the_vocabulary(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, max_tokens=1)
    err = _refused(scripted_client.completions.create, prompt="Hello", logprobs=10**6, **kw)
    assert err.param == "logprobs", err.body
    vocab = int(re.search(r"greater than max allowed: (\d+)$", err.message).group(1))
    out = scripted_client.completions.create(prompt="Hello", logprobs=vocab, **kw)
    (top,) = out.choices[0].logprobs.top_logprobs
    assert vocab > 20 and len(top) == vocab
    chat = scripted_client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=vocab, **kw)
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == vocab
    err = _refused(scripted_client.completions.create, prompt="Hello", logprobs=vocab + 1, **kw)
    assert err.param == "logprobs" and err.body["message"] == (
        f"Requested sample logprobs of {vocab + 1}, which is greater than max allowed: {vocab}")


def test_minus_one_asks_for_the_whole_vocabulary(scripted_server, scripted_client):
    """vLLM's ``-1``: chat's ``top_logprobs`` and ``prompt_logprobs`` (both routes) list every
    token of the vocabulary where the server's bound is the vocabulary; a completion's
    ``logprobs`` never takes it (vLLM's request model refuses it)."""
    kw = dict(model=scripted_server.model, max_tokens=2)
    err = _refused(scripted_client.completions.create, prompt="Hello", logprobs=10**6, **kw)
    vocab = int(re.search(r"greater than max allowed: (\d+)$", err.message).group(1))
    chat = scripted_client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=-1,
        extra_body={"prompt_logprobs": -1, "return_token_ids": True}, **kw)
    content = chat.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == vocab for e in content)
    assert all(len({t.token for t in e.top_logprobs}) == vocab for e in content)  # by id
    plps = chat.model_extra["prompt_logprobs"]
    assert len(plps) == len(chat.model_extra["prompt_token_ids"]) and plps[0] is None
    assert all(len(p) == vocab for p in plps[1:])
    out = scripted_client.completions.create(prompt="Hello there", **kw,
                                             extra_body={"prompt_logprobs": -1})
    plps = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plps) == out.usage.prompt_tokens and all(len(p) == vocab for p in plps[1:])
    err = _refused(scripted_client.completions.create, prompt="Hello", logprobs=-1, **kw)
    assert (err.param, err.body["message"]) == ("logprobs",
                                                "`logprobs` must be a positive value.")
