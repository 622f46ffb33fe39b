"""The sampling fields of /v1/messages (Anthropic) and /v1/responses reach sampling, as their
users see it: at temperature 1 the random demo model's text is near uniform noise, so an
answer equal to the greedy one shows a filter that kept only the most likely token (Anthropic's
``top_k: 1``, or a ``top_p`` below any token's probability), and an answer that differs shows
that without it the request really sampled."""

from __future__ import annotations

import anthropic
import pytest

LONG = [{"role": "user", "content": "Tell me a long story about the experts of the mixture."}]
TOKENS = 16


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, api_key=server.api_key, max_retries=0,
                               timeout=120)


def _message(claude, server, **sampling) -> str:
    # this client has no sampling keywords: they travel as extra_body, as the wire has them
    msg = claude.messages.create(model=server.model, messages=LONG, max_tokens=TOKENS,
                                 extra_body=sampling)
    assert msg.usage.output_tokens == TOKENS and msg.stop_reason == "max_tokens"
    return msg.content[0].text


def test_anthropic_top_k_and_top_p_reach_sampling(server, claude):
    greedy = _message(claude, server, temperature=0)
    assert _message(claude, server, temperature=1, top_k=1) == greedy
    assert _message(claude, server, temperature=1, top_p=1e-6) == greedy
    assert _message(claude, server, temperature=1, top_k=2) != greedy  # still sampling
    assert _message(claude, server, temperature=1) != greedy


def test_anthropic_sampled_stream_honours_top_k(server, claude):
    greedy = _message(claude, server, temperature=0)
    with claude.messages.stream(model=server.model, messages=LONG, max_tokens=TOKENS,
                                extra_body={"temperature": 1, "top_k": 1}) as stream:
        assert "".join(stream.text_stream) == greedy


def test_responses_top_p_reaches_sampling(server, client):
    def answer(**sampling):
        r = client.responses.create(model=server.model, input=LONG[0]["content"],
                                    max_output_tokens=TOKENS, **sampling)
        assert r.usage.output_tokens == TOKENS and r.status == "incomplete"
        for name, value in sampling.items():  # echoed as asked
            assert getattr(r, name) == value
        return r.output_text

    greedy = answer(temperature=0)
    assert answer(temperature=1, top_p=1e-6) == greedy
    assert answer(temperature=1, top_p=1.0) != greedy
    events = list(client.responses.create(model=server.model, input=LONG[0]["content"],
                                          max_output_tokens=TOKENS, temperature=1, top_p=1e-6,
                                          stream=True))
    assert events[-1].type == "response.incomplete"  # cut by max_output_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == greedy


@pytest.mark.parametrize("top_p", [0.0, 1.5, -0.1])
def test_responses_refuse_a_top_p_out_of_range(server, client, top_p):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=server.model, input="Hi", max_output_tokens=2,
                                top_p=top_p)
    assert e.value.body["param"] == "top_p" and "top_p" in e.value.message, e.value.body
