"""vLLM's chat ``echo`` with the openai client, greedy on the session server: the last message's
content goes before the reply's when it is in the reply's role — the assistant's after a
generation prompt, else the last message's own (vLLM's reply role then) — whole and streamed
alike; otherwise it adds nothing."""

from __future__ import annotations

ASK = [{"role": "user", "content": "Tell me a story"}]
PREFILL = "Once upon a time"
GREEDY = dict(max_tokens=6, temperature=0)


def _whole(server, client, messages, **extra):
    out = client.chat.completions.create(model=server.model, messages=messages, **GREEDY,
                                         extra_body=extra)
    return out.choices[0].message


def _streamed(server, client, messages, **extra) -> tuple[str | None, str]:
    role, text = None, ""
    for chunk in client.chat.completions.create(model=server.model, messages=messages,
                                                stream=True, **GREEDY, extra_body=extra):
        for c in chunk.choices:
            role = role or c.delta.role
            text += c.delta.content or ""
    return role, text


def test_echo_puts_the_continued_message_before_the_reply(server, client):
    msgs = ASK + [{"role": "assistant", "content": PREFILL}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    plain = _whole(server, client, msgs, **cont)
    echoed = _whole(server, client, msgs, echo=True, **cont)
    assert plain.content and not plain.content.startswith(PREFILL)
    assert echoed.content == PREFILL + plain.content and echoed.role == "assistant"
    assert _streamed(server, client, msgs, echo=True, **cont) == ("assistant", echoed.content)


def test_echo_after_a_generation_prompt_needs_an_assistant_last_message(server, client):
    plain = _whole(server, client, ASK)
    assert _whole(server, client, ASK, echo=True).content == plain.content  # a user's: none
    msgs = ASK + [{"role": "assistant", "content": PREFILL}]  # then a new assistant turn
    assert _whole(server, client, msgs, echo=True).content == \
        PREFILL + _whole(server, client, msgs).content


def test_without_a_generation_prompt_the_reply_goes_on_in_the_last_role(server, client):
    """vLLM's: no generation prompt, so the reply continues the last message, in its role."""
    plain = _whole(server, client, ASK, add_generation_prompt=False)
    assert plain.role == "user"
    echoed = _whole(server, client, ASK, add_generation_prompt=False, echo=True)
    assert echoed.role == "user" and echoed.content == ASK[0]["content"] + plain.content
    assert _streamed(server, client, ASK, add_generation_prompt=False, echo=True) == (
        "user", echoed.content)
