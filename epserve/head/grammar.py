"""The head's grammars: structured output compiled with xgrammar, and one matcher per sequence.

``GrammarBook`` (one per engine) compiles a request's ``StructuredOutputsParams`` against the
model's tokenizer (xgrammar's ``TokenizerInfo``, vocabulary size = the logits' width, stop
tokens = the engine's EOS ids) and caches what it compiled. ``SeqGrammar`` is one sequence's
``GrammarMatcher`` and its mask buffer: the engine advances it with each appended token and
refills the mask for the next step right then (off the step's critical path: the model reads
the buffer when it builds the next step command). Invariants: a sequence's mask always
describes its next token given every token it has; a token the matcher refuses, or a mask
that leaves no token the row may sample, fails that sequence only; ``compile`` is
thread-safe (the async engine compiles on the caller's side, before the request is queued).
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

import numpy as np

from epserve.head.structured_params import (
    StructuredOutputsParams, parse_grammar, xgrammar_reason,
)

_CACHE_ENTRIES = 256


class SeqGrammar:
    """One sequence's matcher and its next-token mask (``mask``: [ceil(V / 32)] int32,
    refilled in place)."""

    __slots__ = ("matcher", "mask", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.mask = np.zeros(-(-vocab_size // 32), dtype=np.int32)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output is done."""
        return bool(self.matcher.is_terminated())

    def fill(self, banned: Iterable[int] = ()) -> bool:
        """Refill ``mask`` for the next token; ``banned`` ids (the row's bans this step) are
        cleared from it. False when no token is left to sample."""
        self.matcher.fill_next_token_bitmask(self.mask)
        bits = self.mask.view(np.uint32)
        for t in banned:
            if 0 <= t < self.vocab_size:
                bits[t >> 5] &= np.uint32(0xFFFFFFFF ^ (1 << (t & 31)))
        return bool(bits.any())

    def allow(self, token_id: int) -> None:
        """Add ``token_id`` to the mask filled last (for one token: the next fill replaces
        it)."""
        self.mask.view(np.uint32)[token_id >> 5] |= np.uint32(1 << (token_id & 31))


class GrammarBook:
    """Compiles constraints for one engine's tokenizer and vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(set(stop_ids))
        self._compiler: Any = None
        self._cache: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xg

                tok = self.tokenizer
                if not hasattr(tok, "get_vocab") or not hasattr(tok, "convert_ids_to_tokens"):
                    raise ValueError("SamplingParams.structured_outputs needs the model's "
                                     "tokenizer, and this model folder has none")
                info = xg.TokenizerInfo.from_huggingface(
                    tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids or None)
                self._compiler = xg.GrammarCompiler(info, cache_enabled=False)
            return self._compiler

    def compile(self, p: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``p`` (cached); ``ValueError`` naming the field when it
        cannot be compiled for this tokenizer."""
        key = (p.kind, repr(getattr(p, p.kind)), p.disable_any_whitespace)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        compiler = self._get_compiler()
        grammar = parse_grammar(p)
        try:
            compiled = compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"SamplingParams.structured_outputs.{p.kind} cannot be compiled "
                             f"for this model's tokenizer: {xgrammar_reason(exc)}") from None
        with self._lock:
            if len(self._cache) >= _CACHE_ENTRIES:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = compiled
        return compiled

    def matcher(self, compiled: Any) -> SeqGrammar:
        """A fresh sequence matcher (its mask is filled by ``fill``)."""
        import xgrammar as xg

        m = xg.GrammarMatcher(compiled, terminate_without_stop_token=not self.stop_ids)
        return SeqGrammar(m, self.vocab_size)
