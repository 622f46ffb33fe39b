"""Incremental detokenisation of one completion: new text per token, in O(window) per token.

Invariants: ``text`` only ever grows, and never ends in a partial UTF-8 character (a decode
that ends with U+FFFD is held back until a later token completes it, or ``finish``). After
``finish()``, ``text`` equals ``tokenizer.decode(output_ids)`` for byte-level BPE tokenizers;
for SentencePiece-style ones it keeps the leading space the prompt context gives (as vLLM).
With a Rust-backed tokenizer (``tokenizers.Tokenizer``, or a transformers fast tokenizer that
does not clean up spaces) each token is one ``tokenizers.decoders.DecodeStream.step`` (the same
window technique in Rust, ~8x cheaper than two Python-side decodes; vLLM uses it too); any other
tokenizer gets the same technique through its ``decode``. No torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

_REPLACEMENT = "\ufffd"

#: Prompt tokens decoded in front of the first output token: tokenizers that strip the leading
#: space of a sequence's first word (Metaspace) need left context; a few tokens suffice.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a completion's token ids into text deltas, one ``add`` per token.

    ``tokenizer``: a ``tokenizers.Tokenizer`` or a transformers tokenizer; only its
    ``decode(ids, skip_special_tokens=...)`` is used. ``prompt_token_ids``: the request's
    prompt, whose tail gives the first tokens their left context.

    Technique: keep ``_tokens`` = context tail + outputs, and two offsets into it. Text before
    ``_read`` has been emitted; ``_prefix`` marks where the decode window starts (one token
    run earlier, so the decoder sees the left context of the new tokens). Each ``add`` decodes
    ``_tokens[_prefix:_read]`` and ``_tokens[_prefix:]`` and emits the difference.
    """

    __slots__ = ("_tok", "_skip", "_tokens", "_prefix", "_read", "_text", "_n_out", "_rust",
                 "_stream")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._tokens: list[int] = self._context(list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._prefix = 0
        self._read = len(self._tokens)
        self._text = ""
        self._n_out = 0
        self._rust = rust_tokenizer(tokenizer)
        self._stream = (None if self._rust is None else
                        DecodeStream(ids=list(self._tokens), skip_special_tokens=skip_special_tokens))

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tok.decode(list(ids), skip_special_tokens=self._skip)

    def _context(self, tail: list[int]) -> list[int]:
        # A prompt cut inside a UTF-8 character would glue its bytes to the first output
        # bytes; the output text alone must not depend on that, so drop such a context.
        if self._decode(tail).endswith(_REPLACEMENT):
            return []
        return tail

    @property
    def text(self) -> str:
        """The output text emitted so far (held-back partial characters excluded)."""
        return self._text

    @property
    def num_tokens(self) -> int:
        """Output tokens added so far."""
        return self._n_out

    @property
    def pending(self) -> bool:
        """True when some added tokens' text is held back (a partial character so far)."""
        return self._read < len(self._tokens)

    def add(self, token_id: int) -> str:
        """Append one output token; return the newly completed text (may be "")."""
        self._tokens.append(int(token_id))
        self._n_out += 1
        if self._stream is not None:
            delta = self._stream.step(self._rust, self._tokens[-1])
            if not delta:  # held back (a partial character), or nothing visible yet
                return ""
            self._prefix, self._read = self._read, len(self._tokens)
            self._text += delta
            return delta
        prefix_text = self._decode(self._tokens[self._prefix:self._read])
        new_text = self._decode(self._tokens[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # Either nothing visible yet (a special token skipped, a space merged) or the
            # last character is incomplete: wait for more tokens before committing offsets.
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._tokens)
        self._text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back at the end of the completion (trailing U+FFFD included, as a
        whole-sequence decode renders incomplete bytes); returns that delta."""
        if not self.pending:
            return ""
        prefix_text = self._decode(self._tokens[self._prefix:self._read])
        new_text = self._decode(self._tokens[self._prefix:])
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._tokens)
        self._text += delta
        return delta


def rust_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` whose decode is exactly ``tokenizer.decode``'s, or None
    (a transformers tokenizer that cleans up tokenization spaces decodes differently)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces",
                                                      False):
        return backend
    return None
