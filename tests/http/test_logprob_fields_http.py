"""A request's logprob fields as vLLM's server takes them, on the session server (the default
``--max-logprobs`` 20), with the openai client: chat's whole ``prompt_logprobs`` are the prompt's
(the completions route's and the offline LLM's on the same token ids); ``prompt_logprobs``
with ``stream`` is a 400 in vLLM's words on both routes (no chunk would carry them); ``-1``
(the whole vocabulary) is refused here as vLLM refuses it under a bound of 20, naming the
vocabulary size (test_max_logprobs_http serves it); other negative values are 400s in vLLM's
words."""

from __future__ import annotations

import json

import openai
import pytest

from epserve import SamplingParams

CHAT = [{"role": "user", "content": "Tell me about the experts"}]


def _refused(call, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        call(**kw)
    return e.value


def _vocab(demo_model_dir) -> int:
    return json.loads((demo_model_dir / "config.json").read_text())["vocab_size"]


def test_whole_chat_prompt_logprobs_are_the_prompts(server, client, offline_llm):
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=1,
                                          temperature=0, extra_body={
                                              "prompt_logprobs": 2, "return_token_ids": True})
    ids, got = chat.model_extra["prompt_token_ids"], chat.model_extra["prompt_logprobs"]
    assert len(got) == len(ids) == chat.usage.prompt_tokens and got[0] is None
    cmpl = client.completions.create(model=server.model, prompt=ids, max_tokens=1,
                                     temperature=0, extra_body={"prompt_logprobs": 2})
    want = cmpl.choices[0].model_extra["prompt_logprobs"]
    offline = offline_llm.generate({"prompt_token_ids": ids},
                                   SamplingParams(max_tokens=1, temperature=0,
                                                  prompt_logprobs=2))[0].prompt_logprobs
    for pos, tid, same, off in zip(got[1:], ids[1:], want[1:], offline[1:]):
        assert list(pos)[0] == str(tid)  # the prompt's own token first, then the top 2
        assert list(pos) == list(same) == [str(t) for t in off] and 2 <= len(pos) <= 3
        for t, entry in pos.items():
            assert entry["logprob"] == pytest.approx(same[t]["logprob"], abs=1e-5)
            assert entry["logprob"] == pytest.approx(off[int(t)].logprob, abs=1e-4)
            assert entry["rank"] == same[t]["rank"] == off[int(t)].rank
    plain = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=1)
    assert plain.model_extra["prompt_logprobs"] is None  # only when asked for


@pytest.mark.parametrize("value", [0, 2, -1])
def test_streamed_prompt_logprobs_are_refused_as_vllm_refuses_them(server, client, value):
    """vLLM refuses 2 and -1 this way and lets 0 through to drop it; here 0 is refused too."""
    for call, kw in ((client.chat.completions.create, {"messages": CHAT}),
                     (client.completions.create, {"prompt": "Hi"})):
        err = _refused(call, model=server.model, max_tokens=2, stream=True,
                       extra_body={"prompt_logprobs": value}, **kw)
        assert err.param == "prompt_logprobs", err.body
        assert err.body["message"] == "`prompt_logprobs` are not available when `stream=True`."
    # a streamed echo with logprobs still gives the prompt's tokens their logprobs, as vLLM's
    chunks = list(client.completions.create(model=server.model, prompt="Hello there",
                                            max_tokens=2, stream=True, echo=True, logprobs=1))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and first.token_logprobs[1] is not None


def test_the_whole_vocabulary_is_refused_under_the_default_bound(server, client,
                                                                 demo_model_dir):
    vocab = _vocab(demo_model_dir)
    kw = dict(model=server.model, max_tokens=1)
    err = _refused(client.chat.completions.create, messages=CHAT, logprobs=True,
                   top_logprobs=-1, **kw)
    assert (err.param, err.body["message"]) == (
        "logprobs", f"Requested sample logprobs of {vocab}, which is greater than max allowed: 20")
    for call, route in ((client.chat.completions.create, {"messages": CHAT}),
                        (client.completions.create, {"prompt": "Hi"})):
        err = _refused(call, extra_body={"prompt_logprobs": -1}, **route, **kw)
        assert (err.param, err.body["message"]) == (
            "prompt_logprobs",
            f"Requested prompt logprobs of {vocab}, which is greater than max allowed: 20")


@pytest.mark.parametrize("route, field, extra, message", [
    ("completions", "logprobs", {"logprobs": -1}, "`logprobs` must be a positive value."),
    ("completions", "prompt_logprobs", {"prompt_logprobs": -2},
     "`prompt_logprobs` must be a positive value or -1."),
    ("chat", "prompt_logprobs", {"prompt_logprobs": -2},
     "`prompt_logprobs` must be a positive value or -1."),
    ("chat", "top_logprobs", {"logprobs": True, "top_logprobs": -2},
     "`top_logprobs` must be a positive value or -1."),
    ("chat", "top_logprobs", {"top_logprobs": -1},
     "when using `top_logprobs`, `logprobs` must be set to true."),
])
def test_other_negative_values_are_refused_in_vllms_words(server, client, route, field, extra,
                                                          message):
    """vLLM's request models: a completion's ``logprobs`` never takes -1 (chat's
    ``top_logprobs`` and ``prompt_logprobs`` do)."""
    call, kw = ((client.completions.create, {"prompt": "Hi"}) if route == "completions"
                else (client.chat.completions.create, {"messages": CHAT}))
    err = _refused(call, model=server.model, max_tokens=1, extra_body=extra, **kw)
    assert (err.param, err.body["message"]) == (field, message), err.body
