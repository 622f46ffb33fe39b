"""A conversation rendered through the model's chat template: messages, tools and the request's
``chat_template_kwargs``, as vLLM passes them to ``tokenizer.apply_chat_template``.

Invariants: nothing the template would drop is accepted — tools for a template that never
reads ``tools``, earlier tool calls for one that never reads ``tool_calls``, or a
``chat_template_kwargs`` key it never reads, are each a 400 naming the field; keys that are
``apply_chat_template``'s own arguments (``tokenize``, ``chat_template``, ...) cannot be set
through ``chat_template_kwargs``. A template's error is a 400 naming ``messages``.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from epserve.deploy.errors import bad_request

#: apply_chat_template's own arguments: the request sets these through its own fields or not
#: at all.
_RESERVED = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs", "add_generation_prompt", "continue_final_message"})
_OWN_FIELDS = {"add_generation_prompt", "continue_final_message", "tools"}


def _sources(tok: Any) -> tuple[str, ...]:
    """The tokenizer's chat template(s) as text ("" when it has none)."""
    t = getattr(tok, "chat_template", None)
    if isinstance(t, dict):
        return tuple(str(v) for v in t.values())
    return (t,) if isinstance(t, str) else ()


@functools.lru_cache(maxsize=8)
def _variables(sources: tuple[str, ...]) -> frozenset[str]:
    """The top-level names the templates read (what a render call can pass them)."""
    import jinja2
    from jinja2 import meta

    env = jinja2.Environment()
    names: set[str] = set()
    for src in sources:
        try:
            names |= meta.find_undeclared_variables(env.parse(src))
        except jinja2.TemplateSyntaxError:
            continue  # rendering reports it, as a 400 naming messages
    return frozenset(names)


def check_template_inputs(tok: Any, tools: Sequence[dict] | None,
                          messages: Sequence[dict[str, Any]],
                          kwargs: dict[str, Any] | None) -> None:
    """A 400 for anything this template would silently drop (see the module's invariants)."""
    sources = _sources(tok)
    names = _variables(sources)
    if tools and "tools" not in names:
        raise bad_request("tools: this model's chat template does not render tools, so the "
                          "model would never see them", param="tools")
    if any(m.get("tool_calls") for m in messages) and not any("tool_calls" in s
                                                               for s in sources):
        raise bad_request("messages: this model's chat template does not render earlier tool "
                          "calls (tool_calls)", param="messages")
    for key in kwargs or {}:
        if key in _RESERVED:
            how = "set it as the request's own field" if key in _OWN_FIELDS else \
                "it is not the template's to read"
            raise bad_request(f"chat_template_kwargs.{key} cannot be set here: {how}",
                              param="chat_template_kwargs")
        if key not in names:
            raise bad_request(f"chat_template_kwargs.{key}: this model's chat template does not "
                              f"use it", param="chat_template_kwargs")


def render(tok: Any, messages: list[dict[str, Any]], *, tools: list[dict] | None,
           add_generation_prompt: bool, continue_final: bool,
           kwargs: dict[str, Any] | None) -> str:
    """The template's text for ``messages`` (checked first: ``check_template_inputs``)."""
    check_template_inputs(tok, tools, messages, kwargs)
    try:
        return tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final, **(kwargs or {}))
    except Exception as exc:  # jinja2 errors, a template's raise_exception(...)
        raise bad_request(f"the chat template failed on these messages: {exc}",
                          param="messages") from None


__all__ = ["check_template_inputs", "render"]
