"""``logit_bias`` on /v1/completions and /v1/chat/completions with the official openai client,
against the shared demo server (conftest): a bias of +100 makes the model write that token
(greedy and sampled), -100 keeps it out; the logprobs stay those of the raw logits; a key
that is no integer, or an id outside the vocabulary, is a 400 naming it (vLLM's checks)."""

from __future__ import annotations

import openai
import pytest

CHAT = [{"role": "user", "content": "Say something."}]
TARGET = 1234  # any id of the demo model's 2048


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_a_bias_steers_completions_and_chat(server, client):
    bias = {str(TARGET): 100}
    out = client.completions.create(model=server.model, prompt="Hello", max_tokens=3,
                                    temperature=0, logit_bias=bias,
                                    extra_body={"return_token_ids": True})
    assert _ids(out.choices[0]) == [TARGET] * 3
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=3,
                                          n=2, temperature=1.0, seed=5, logit_bias=bias,
                                          extra_body={"return_token_ids": True})
    assert [_ids(c) for c in chat.choices] == [[TARGET] * 3] * 2
    plain = client.completions.create(model=server.model, prompt="Hello", max_tokens=2,
                                      temperature=0, extra_body={"return_token_ids": True})
    first = _ids(plain.choices[0])[0]
    kept_out = client.completions.create(model=server.model, prompt="Hello", max_tokens=1,
                                         temperature=0, logit_bias={str(first): -100},
                                         extra_body={"return_token_ids": True})
    assert _ids(kept_out.choices[0]) != [first]


def test_logprobs_are_the_raw_ones(server, client):
    kw = dict(model=server.model, messages=CHAT, max_tokens=1, temperature=0, logprobs=True,
              top_logprobs=3, extra_body={"return_tokens_as_token_ids": True})
    plain = client.chat.completions.create(**kw).choices[0].logprobs.content[0]
    biased = client.chat.completions.create(logit_bias={str(TARGET): 100}, **kw)
    got = biased.choices[0].logprobs.content[0]
    assert got.token == f"token_id:{TARGET}"
    # vLLM's order: the sampled token first (its raw logprob, far from the top), then the top
    # 2 of the raw logits: the same as without the bias, so the bias changed no logprob
    assert [(t.token, t.logprob) for t in got.top_logprobs] == \
        [(got.token, got.logprob)] + [(t.token, t.logprob) for t in plain.top_logprobs][:2]
    assert got.logprob < plain.top_logprobs[2].logprob


@pytest.mark.parametrize("bias, says", [
    ({"2048": 5, "3": 1}, "2048 is not a token id"),       # the vocabulary is [0, 2048)
    ({"-1": 5}, "-1"),
    ({"the": 5}, "'the'"),
])
def test_bad_ids_are_a_400_naming_them(server, client, bias, says):
    for call, kw in ((client.completions.create, {"prompt": "Hi"}),
                     (client.chat.completions.create, {"messages": CHAT})):
        with pytest.raises(openai.BadRequestError) as e:
            call(model=server.model, max_tokens=2, logit_bias=bias, **kw)
        assert e.value.param == "logit_bias" and says in e.value.message, e.value.body
