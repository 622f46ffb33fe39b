"""``--return-tokens-as-token-ids`` (vLLM's serve flag) with the openai client, on the scripted
server (conftest), which runs with it: every logprobs token string, chosen and alternative, on
completions and chat, streamed or not, is ``token_id:N``; a request's own
``return_tokens_as_token_ids: false`` gets the token texts back."""

from __future__ import annotations

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_the_flag_names_every_logprob_token_by_id(scripted_server, scripted_client):
    kw = dict(model=scripted_server.model, max_tokens=3, temperature=0,
              extra_body={"return_token_ids": True})
    out = scripted_client.completions.create(prompt="Hello", logprobs=2, **kw).choices[0]
    ids = out.model_extra["token_ids"]
    assert out.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in out.logprobs.top_logprobs for k in top)
    chat = scripted_client.chat.completions.create(messages=ASK, logprobs=True, top_logprobs=2,
                                                   **kw).choices[0]
    entries = chat.logprobs.content
    assert [e.token for e in entries] == [f"token_id:{t}" for t in chat.model_extra["token_ids"]]
    assert all(a.token.startswith("token_id:") for e in entries for a in e.top_logprobs)
    streamed = [e.token for ch in scripted_client.chat.completions.create(
        messages=ASK, logprobs=True, stream=True, **kw) for c in ch.choices
        if c.logprobs for e in c.logprobs.content]
    assert streamed == [e.token for e in entries]


def test_a_request_may_ask_for_the_texts(scripted_server, scripted_client):
    out = scripted_client.chat.completions.create(
        model=scripted_server.model, messages=ASK, max_tokens=2, temperature=0, logprobs=True,
        extra_body={"return_tokens_as_token_ids": False}).choices[0]
    assert [e.token for e in out.logprobs.content][:1] == ["<think>"]
