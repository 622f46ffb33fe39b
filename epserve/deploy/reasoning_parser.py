"""Reasoning parsers (vLLM's ``--reasoning-parser``): a choice's text split into the reasoning
between ``<think>`` and ``</think>`` and the content after it, whole or as it streams.

Invariants: the splitter never sends a character twice or drops one that is not a tag: what it
returns as reasoning and content, concatenated in order with the two tags put back, is the
text it was fed (less the leading whitespace before an opening ``<think>``); a text that could
still become a tag (``</thi`` at the end of a piece) is held until the next piece or ``finish``
decides it; a text fed whole and the same text fed in any pieces give the same split.

Rules (vLLM's ``qwen3``, decided from the prompt and the output alone):
- the prompt leaves a ``<think>`` open (a template that starts the thinking block itself, or a
  prefilled assistant message): the output is reasoning up to ``</think>``, content after it;
  with no ``</think>`` (cut by max_tokens) it is all reasoning;
- otherwise an output that starts (after whitespace) with ``<think>`` is reasoning up to
  ``</think>``; any other output is all content (``</think>`` in it is text).
``deepseek_r1`` is the same with the thinking block always open, as DeepSeek-R1 always thinks.
"""

from __future__ import annotations

# the names and tags are the engine's too (it bans closed tags, holds grammars until the end)
from epserve.head.reasoning import REASONING_PARSERS, THINK_END, THINK_START


def held_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is the start of ``tag`` (0 when none):
    what must be held back until more text says whether it is the tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def prompt_opens_thinking(prompt_text: str | None, final_message: str | None = None) -> bool:
    """Whether generation starts inside a thinking block: the rendered prompt ends with
    ``<think>`` (and whitespace), or the continued final assistant message ``final_message``
    has an unclosed ``<think>``."""
    if prompt_text is not None and prompt_text.rstrip().endswith(THINK_START):
        return True
    if final_message:
        return final_message.rfind(THINK_START) > final_message.rfind(THINK_END)
    return False


class ReasoningSplitter:
    """One choice's text, fed in pieces, split into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool):
        self._state = "reasoning" if in_reasoning else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content ``text`` decides (either may be empty)."""
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._state == "start":
            head = buf.lstrip()
            if not head or (len(head) < len(THINK_START) and THINK_START.startswith(head)):
                self._held = buf  # whitespace, or what may still become "<think>"
                return "", ""
            if head.startswith(THINK_START):
                self._state, buf = "reasoning", head[len(THINK_START):]
            else:
                self._state = "content"
        if self._state == "reasoning":
            end = buf.find(THINK_END)
            if end < 0:
                keep = held_suffix(buf, THINK_END)
                self._held = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(THINK_END):]
            self._state = "content"
        content = buf
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held, decided now that the text is complete."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        return "", held


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str | None, str | None]:
    """A whole text's (reasoning, content), each None when empty."""
    s = ReasoningSplitter(in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2) or None, (c1 + c2) or None


def starts_in_reasoning(parser: str, prompt_text: str | None,
                        final_message: str | None = None) -> bool:
    """Whether ``parser``'s split of a reply to this prompt starts inside the thinking block."""
    if parser == "deepseek_r1":
        return True
    return prompt_opens_thinking(prompt_text, final_message)


__all__ = ["REASONING_PARSERS", "ReasoningSplitter", "held_suffix", "split_reasoning",
           "starts_in_reasoning"]
