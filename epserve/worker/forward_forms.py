"""The seed's forward forms and logits reads over one ``mixed_forward_batch``.

Owns ``prefill``, ``prefill_chunk``, ``decode``, ``decode_batch``, ``mixed_forward``,
``prefill_batch_chunk``, ``decode_verify_batched`` (each one call of ``mixed_forward_batch``) and ``argmax_batch`` /
``argmax_batch_masked`` over a logits tensor, written once for every class that implements
``mixed_forward_batch`` (the one-rank runner and the EP leader), so both are a whole
``models.traits.Model``. Invariant: every form is exactly the step ``mixed_forward_batch`` runs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from epserve.models.traits import (
    MixedBatchResult, MixedForwardResult, PrefillSlice, RowMask, SampledToken, SequenceState,
    VerifyBatchedOpts, ROW_MASK_NONE,
)


class ForwardForms:
    """Mixed into a class that defines ``mixed_forward_batch``."""

    mixed_forward_batch: Callable[..., MixedBatchResult]

    def prefill(self, tokens: Sequence[int], seq: SequenceState) -> SampledToken:
        out = self.prefill_chunk(tokens, seq, seq.seq_len, len(tokens) - seq.seq_len, True)
        assert out is not None
        return out

    def prefill_chunk(self, tokens: Sequence[int], seq: SequenceState, chunk_start: int,
                      chunk_len: int, is_last_chunk: bool) -> SampledToken | None:
        sl = PrefillSlice(tokens, seq, chunk_start, chunk_len, is_last_chunk)
        return self.mixed_forward_batch((), (), [sl]).prefill[0]

    def decode(self, token: int, seq: SequenceState) -> SampledToken:
        return self.decode_batch([token], [seq])[0]

    def decode_batch(self, tokens: Sequence[int],
                     seqs: Sequence[SequenceState]) -> tuple[SampledToken, ...]:
        return self.mixed_forward_batch(tokens, seqs, ()).decode

    def mixed_forward(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      prefill_tokens: Sequence[int], prefill_seq: SequenceState,
                      prefill_chunk_start: int, prefill_chunk_len: int,
                      prefill_is_last: bool) -> MixedForwardResult:
        sl = PrefillSlice(prefill_tokens, prefill_seq, prefill_chunk_start, prefill_chunk_len,
                          prefill_is_last)
        res = self.mixed_forward_batch(decode_tokens, decode_seqs, [sl])
        return MixedForwardResult(decode=res.decode, prefill=res.prefill[0],
                                  decode_logits=res.decode_logits,
                                  prefill_logits=res.prefill_logits)

    def prefill_batch_chunk(self, slices: Sequence[PrefillSlice]
                            ) -> tuple[SampledToken | None, ...]:
        return self.mixed_forward_batch((), (), slices).prefill

    def decode_verify_batched(self, tokens: Sequence[int], ks: Sequence[int],
                              seqs: Sequence[SequenceState],
                              opts: VerifyBatchedOpts = VerifyBatchedOpts()
                              ) -> tuple[tuple[SampledToken, ...], ...]:
        """``tokens``: per sequence its last token then its ``ks[i]`` drafts. The target's
        token at every position, per sequence; each sequence keeps the accepted prefix."""
        if opts.write_on_accept:  # the seed's caller-side gdn_fold_accepted
            raise ValueError("VerifyBatchedOpts.write_on_accept asks the caller to fold the "
                             "accepted prefix into recurrent states; here every verify does that "
                             "on the sequence's rank itself (ModelSsmState): leave it False")
        if len(ks) != len(seqs) or sum(k + 1 for k in ks) != len(tokens) or min(ks, default=0) < 0:
            raise ValueError(f"decode_verify_batched: {len(tokens)} tokens do not split into "
                             f"{len(seqs)} sequences of 1 + ks={list(ks)}")
        lasts, drafts, at = [], [], 0
        for k in ks:
            lasts.append(tokens[at])
            drafts.append(tuple(tokens[at + 1:at + 1 + k]))
            at += k + 1
        res = self.mixed_forward_batch(lasts, seqs, (), drafts)
        if res.failed:
            raise ValueError(f"decode_verify_batched: rows refused: {res.failed}")
        return tuple(res.verified.get(i, (tok,)) for i, tok in enumerate(res.decode))

    def argmax_batch(self, logits: Any) -> list[int]:
        return [int(i) for i in torch.argmax(logits, dim=-1).tolist()]

    def argmax_batch_masked(self, logits: Any, masks: Sequence[RowMask]) -> list[int]:
        masked = logits.clone()
        for r, mask in enumerate(masks):
            for tok in mask:
                if tok != ROW_MASK_NONE and 0 <= tok < masked.shape[-1]:
                    masked[r, tok] = float("-inf")
        return self.argmax_batch(masked)
