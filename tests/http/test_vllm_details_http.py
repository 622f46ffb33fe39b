"""vLLM's details as its users meet them on the shared demo server: /tokenize renders the chat
template with and without the generation prompt exactly as the model's template does;
``--max-logprobs`` defaults to vLLM's 20 (20 served, 21 refused with vLLM's own words); and a
stream never shows U+FFFD for a character whose bytes arrive in several tokens."""

from __future__ import annotations

import openai
import pytest
import requests

MSGS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]


def _tokenize(server, **body) -> dict:
    r = requests.post(f"{server.base}/tokenize", json={"model": server.model, **body},
                      headers=server.auth, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_with_and_without_the_generation_prompt(server, client, demo_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(demo_model_dir))

    def rendered(gen: bool) -> list[int]:
        text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=gen)
        return tok.encode(text, add_special_tokens=False)

    default = _tokenize(server, messages=MSGS)
    closed = _tokenize(server, messages=MSGS, add_generation_prompt=False)
    assert default["tokens"] == rendered(True) and default["count"] == len(default["tokens"])
    assert closed["tokens"] == rendered(False) and closed["count"] == len(closed["tokens"])
    # the generation prompt is the assistant's header after the same conversation
    n = len(closed["tokens"])
    assert default["tokens"][:n] == closed["tokens"] and len(default["tokens"]) > n
    assert tok.decode(default["tokens"][n:]) == "<|im_start|>assistant\n"
    chat = client.chat.completions.create(model=server.model, messages=MSGS, max_tokens=1,
                                          extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == default["tokens"]  # what generation renders


def _post(server, route: str, body: dict) -> requests.Response:
    return requests.post(f"{server.v1}/{route}", json={"model": server.model, **body},
                         headers=server.auth, timeout=60)


@pytest.mark.parametrize("route, body, param, kind", [
    ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs", "sample"),
    ("completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs", "prompt"),
    ("chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, "logprobs",
     "sample"),
])
def test_21_logprobs_are_refused_as_vllm_refuses_them(server, route, body, param, kind):
    r = _post(server, route, {**body, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param
    assert err["message"] == (f"Requested {kind} logprobs of 21, which is greater than max "
                              f"allowed: 20")


def test_20_logprobs_are_served_by_default(server, client):
    out = client.completions.create(model=server.model, prompt="Hi", max_tokens=2, logprobs=20,
                                    extra_body={"prompt_logprobs": 20,
                                                "return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    assert all(len(top) in (20, 21) for top in lp.top_logprobs)  # + the sampled one if not top
    assert all(len(p) in (20, 21) for p in out.choices[0].model_extra["prompt_logprobs"][1:])
    chat = client.chat.completions.create(model=server.model, messages=MSGS, max_tokens=2,
                                          logprobs=True, top_logprobs=20)
    assert all(len(e.top_logprobs) == 20 for e in chat.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="Hi", max_tokens=2, logprobs=21)
    assert e.value.param == "logprobs"


# every character below is two or three byte tokens of the demo tokenizer, none of them a
# character alone: structured output makes the random model write exactly this (no character
# outside the BMP yet: head/structured_params.py writes a choice's EBNF literal with
# json.dumps's ASCII escapes, which xgrammar reads as two surrogates, so the output is CESU-8)
SPLIT = "é龘ü€"


def test_a_streamed_character_split_across_tokens_never_shows_ufffd(server, client):
    constraint = {"structured_outputs": {"choice": [SPLIT]}}
    chunks = [c for ch in client.completions.create(
        model=server.model, prompt="Say it:", max_tokens=32, temperature=0, stream=True,
        logprobs=0, extra_body=constraint) for c in ch.choices]
    texts = [c.text for c in chunks]
    assert "".join(texts) == SPLIT and not any("\ufffd" in t for t in texts), texts
    held = [c for c in chunks if c.logprobs and c.logprobs.tokens and not c.text]
    assert held, "no token arrived without its text: no character was split across chunks"
    assert chunks[-1].finish_reason == "stop"
    stream = client.chat.completions.create(model=server.model, messages=MSGS, max_tokens=32,
                                            temperature=0, stream=True, extra_body=constraint)
    deltas = [c.delta.content or "" for ch in stream for c in ch.choices]
    assert "".join(deltas) == SPLIT and not any("\ufffd" in d for d in deltas), deltas
