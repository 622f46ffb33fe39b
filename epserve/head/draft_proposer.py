"""The draft-model proposer: a smaller checkpoint with the target's vocabulary drafts greedily.

It runs through the same engine code as the target (a ``Model``: its own KV cache, step
commands, CUDA graphs), on rank 0's device beside the head: drafting is k small sequential
forwards per step, latency-bound and cheap in memory for a small model, so spreading them over
the EP ranks would add a command round per drafted token for nothing. Each target sequence has
a draft sequence (in ``Sequence.draft_state``) whose KV covers a prefix of the target's tokens;
before drafting, the draft is rewound to the longest prefix it shares with the target (what the
target rejected goes) and fed the rest as one chunk, whose sampled token is the first draft;
then one decode step per further draft. Greedy drafts are deterministic (one-hot ``q``), which
is what ``models.acceptance`` needs for exact output. A row whose draft KV cannot be had drafts
nothing; a failed draft step drafts nothing for its rows and drops their draft state.
"""

from __future__ import annotations

from typing import Any, Sequence

from epserve.models.traits import Model, PrefillSlice, RowSampling, SequenceState

_GREEDY = RowSampling(temperature=0.0)


class DraftModelProposer:
    """Drafts up to ``caps[i]`` tokens per sequence with ``model`` (greedy)."""

    def __init__(self, model: Model):
        self.model = model

    def propose_batch(self, seqs: Sequence[Any], caps: Sequence[int]) -> list[tuple[int, ...]]:
        out: list[list[int]] = [[] for _ in seqs]
        rows, slices, states, ks = [], [], [], []
        for i, (seq, k) in enumerate(zip(seqs, caps)):
            if k <= 0:
                continue
            tokens = seq.all_tokens()
            st = self._caught_up(seq, tokens, k)
            if st is None:
                continue
            rows.append(i)
            states.append(st)
            ks.append(k)
            slices.append(PrefillSlice(tokens, st, st.seq_len, len(tokens) - st.seq_len, True))
        if not rows:
            return [() for _ in seqs]
        first = self.model.mixed_forward_batch((), (), slices)
        live = []
        for j, (i, tok) in enumerate(zip(rows, first.prefill)):
            if j in first.failed or tok is None:
                self.release(seqs[i])
                continue
            out[i].append(tok.token_id)
            live.append((i, states[j], ks[j]))
        step = 1
        while True:
            live = [(i, st, k) for i, st, k in live if k > step]
            if not live:
                break
            res = self.model.mixed_forward_batch([out[i][-1] for i, _, _ in live],
                                                 [st for _, st, _ in live], ())
            for r, (i, st, k) in enumerate(live):
                if r in res.failed:
                    self.release(seqs[i])
                    out[i] = []
                else:
                    out[i].append(res.decode[r].token_id)
            live = [(i, st, k) for r, (i, st, k) in enumerate(live) if r not in res.failed]
            step += 1
        return [tuple(o) for o in out]

    def _caught_up(self, seq: Any, tokens: list[int], k: int) -> SequenceState | None:
        """``seq``'s draft sequence, rewound to the prefix it shares with ``tokens`` (all
        but the last token at most), with KV reserved for the rest and ``k - 1`` drafts fed
        after it; None when the draft pool cannot hold it."""
        m, st = self.model, seq.draft_state
        if not isinstance(st, SequenceState):
            st = seq.draft_state = m.alloc_sequence_for(len(tokens) + k)
            st.sampling, st.prompt_len = _GREEDY, len(seq.request.prompt_ids)
        kept, limit = 0, min(st.seq_len, len(tokens) - 1)
        have = st.tokens
        while kept < limit and have[kept] == tokens[kept]:
            kept += 1
        if kept < st.seq_len:
            m.rewind_sequence(st, kept)
        st.output_index = len(seq.output_ids)
        if not m.reserve_blocks(st, len(tokens) + k - 1):
            return None
        return st

    def release(self, seq: Any) -> None:
        """Free ``seq``'s draft sequence (it finished or was preempted)."""
        st, seq.draft_state = seq.draft_state, None
        if isinstance(st, SequenceState):
            self.model.free_sequence(st)
