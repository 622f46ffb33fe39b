"""MtpDrafter: one rank's MTP proposals, run after each step on the step's own hidden states.

The model's MTP head (``models.mtp``) pairs the target's hidden state at position p with the
token at p + 1 and drafts the token at p + 2; its one attention layer keeps a paged KV of its
own over the target's block tables. After the target's forward and sampling, this runs:

- pass 0 over every position the step computed whose next token is now known: a decode row's
  (next: its sampled token), a verify row's accepted prefix and the position after it (next:
  the accepted drafts, then the target's token there; a rejected position is left out; each
  position a one-token row, as in the verify), a prefill chunk's positions (next: the
  prompt's following tokens, then the chunk's ``next_token`` or, on a prompt's last chunk,
  its sampled token). It writes the head's KV at each of those positions (so the head's KV
  always covers what the target computed), and each sampled sequence's last row gives its
  first draft (greedy);
- passes 1..k-1 chain: each drafting sequence one row at the next position, fed its last draft
  and the head's own output hidden (vLLM's chaining), while that position has a KV block (the
  leader reserves them with the step; a sequence without stops drafting early). A pass feeds
  the last one's drafts from the device, so the passes queue back to back and every draft is
  read back once, after the last (one host sync a step, not one a pass).

A pass of one-token rows only (every chain pass; pass 0 of a step without prefill) replays a
CUDA graph of the head (``graphs``: one ``DecodeGraphs`` per head layer, over a static buffer
of the rows' input hidden states, which the pass copies in first).

Invariants: drafts are greedy (deterministic), so verifying them is exact
(``models.acceptance``); a position's head KV written by a chain pass is rewritten by pass 0
once the target computes that position, before any row reads it. Under EP the head's MoE
exchanges tokens between ranks, so every rank runs all k passes of every step, with no rows
where it has none; one rank skips passes with no rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.traits import SampledToken
from epserve.worker.batch import BlockTables, RankRows, StepInputs, build_step_inputs
from epserve.worker.cuda_graphs import DecodeGraphs, graph_batch
from epserve.worker.step_command import PrefillRow


class MtpDrafter:
    """Drafts ``k`` tokens per sampled sequence with ``head`` (an ``MtpHead``) over its KV
    ``caches`` (one per head layer) and the rank's block ``tables``."""

    def __init__(self, head: Any, caches: list, rope: Any, tables: BlockTables, block_size: int,
                 device: torch.device, k: int, world_size: int):
        self.head, self.caches, self.rope = head, caches, rope
        self.tables, self.block_size, self.device = tables, block_size, device
        self.k, self.world_size = k, world_size
        self.graphs: list[DecodeGraphs] = []
        self._hidden_in: torch.Tensor | None = None

    def capture_graphs(self, max_rows: int, eager_twins: bool = False) -> None:
        """Capture the head's passes of up to ``max_rows`` one-token rows (CUDA, one rank),
        one set per head layer (``eager_twins``: see ``DecodeGraphs.capture``)."""
        top = graph_batch(max_rows)
        self._hidden_in = torch.zeros(top, self.head.cfg.hidden_size, device=self.device,
                                      dtype=self.head.fc.weight.dtype)
        buf = self._hidden_in
        for i, cache in enumerate(self.caches):
            def forward(ids, pos, meta, _cache=cache, _step=i):
                return self.head(ids, buf[:ids.shape[0]], pos, _cache, meta, self.rope,
                                 step=_step)

            graphs = DecodeGraphs(forward, self.device, self.block_size, max_rows,
                                  self.tables.max_blocks_per_seq)
            graphs.capture(eager_twins)
            self.graphs.append(graphs)

    @torch.inference_mode()
    def propose(self, rows: RankRows | None, inp: StepInputs | None, hidden: torch.Tensor | None,
                tokens: Sequence[SampledToken], kept: Sequence[int],
                nblocks: np.ndarray) -> dict[int, tuple[int, ...]]:
        """Drafts by slot for this rank's sampled sequences of the step just run. ``hidden``:
        the target's hidden [T, H] at every computed row (flat order of ``inp``); ``tokens``:
        the sampled rows' tokens; ``kept``: each verify row's accepted drafts + 1; ``nblocks``:
        this rank's block count per slot. ``rows`` None: the rank had no rows (EP: it still
        joins every pass)."""
        first = None if rows is None else self._first_pass(rows, inp, tokens, kept)
        if first is None:
            self._idle(self.k)
            return {}
        pass_rows, idx, slots, pick, pos = first
        step_in = build_step_inputs(pass_rows, self.tables, self.block_size, self.device)
        out = self._run(0, step_in, hidden.index_select(0, idx))
        if pick is not None:  # each drafting sequence's last row
            out = out.index_select(0, pick)
        cur = self._greedy(out)  # [n] on the device: the next pass is fed from there
        passes = [(list(slots), cur)]
        live = np.asarray(slots, dtype=np.int64)
        for step in range(1, self.k):
            pos = pos + 1
            ok = pos < nblocks[live] * self.block_size  # the next position has a KV block
            if not ok.all():  # an index from the host: a boolean mask would sync
                keep = torch.as_tensor(np.flatnonzero(ok)).to(out.device, non_blocking=True)
                live, pos = live[ok], pos[ok]
                out, cur = out.index_select(0, keep), cur.index_select(0, keep)
            if not len(live):
                self._idle(self.k - step, step)
                break
            chain = RankRows(live, pos, np.zeros(len(live), dtype=np.int64), (), [], [])
            step_in = build_step_inputs(chain, self.tables, self.block_size, self.device)
            out = self._run(step, step_in, out, cur)
            cur = self._greedy(out)
            passes.append((live.tolist(), cur))
        drafted = torch.cat([c for _, c in passes]).tolist()  # the one read-back of the passes
        drafts: dict[int, list[int]] = {s: [] for s in slots}
        at = 0
        for who, _ in passes:
            for s in who:
                drafts[s].append(drafted[at])
                at += 1
        return {s: tuple(d) for s, d in drafts.items()}

    def _first_pass(self, rows: RankRows, inp: StepInputs, tokens: Sequence[SampledToken],
                    kept: Sequence[int]) -> tuple | None:
        """Pass 0's rows (decode rows, then each verify row's kept positions as one-token rows,
        then each prefill chunk as a chunk), the flat target rows they read, the drafting
        slots in the order of their last rows, those rows among the pass's rows (None: every
        row) and their positions."""
        nplain = rows.num_decode - rows.num_verify_positions
        tok = [t.token_id for t in tokens]
        d_slots, d_pos = [rows.decode_slots[:nplain]], [rows.decode_pos[:nplain]]
        d_ids = [np.array(tok[:nplain], dtype=np.int64)]
        idx, pick = list(range(nplain)), list(range(nplain))
        chunks: list[PrefillRow] = []
        at, flat = nplain, nplain  # the next sampled token, the next flat target row
        for v, m in zip(rows.verify, kept):
            nxt = [int(d) for d in v.drafts[:m - 1]] + [tok[at + m - 1]]
            d_slots.append(np.full(m, v.slot, dtype=np.int64))
            d_pos.append(np.arange(v.start, v.start + m, dtype=np.int64))
            d_ids.append(np.array(nxt, dtype=np.int64))
            idx.extend(range(flat, flat + m))
            pick.append(len(idx) - 1)
            at, flat = at + len(v.tokens), flat + len(v.tokens)
        slots = np.concatenate(d_slots).tolist()
        pos = [int(p) for p in np.concatenate(d_pos)[pick]] if pick else []
        drafting = [slots[r] for r in pick]
        qsl = inp.meta.query_start_loc
        for r, p in enumerate(rows.prefill):
            start = qsl[rows.first_prefill_seq + r]
            last = tok[at] if p.sample else p.next_token
            at += bool(p.sample)
            nxt = tuple(int(t) for t in p.tokens[1:]) + ((last,) if last >= 0 else ())
            if nxt:
                chunks.append(PrefillRow(0, p.slot, p.start, nxt, bool(p.sample), 0, -1))
                idx.extend(range(start, start + len(nxt)))
                if p.sample:
                    pick.append(len(idx) - 1)
                    pos.append(p.start + len(nxt) - 1)
                    drafting.append(p.slot)
        if not idx:
            return None
        pass_rows = RankRows(np.concatenate(d_slots), np.concatenate(d_pos),
                             np.concatenate(d_ids), chunks, [], [])
        dev = lambda x: torch.tensor(x, dtype=torch.int64).to(  # noqa: E731
            self.device, non_blocking=True)
        sel = None if pick == list(range(len(idx))) else dev(pick)
        return pass_rows, dev(idx), drafting, sel, np.array(pos, dtype=np.int64)

    def _run(self, step: int, inp: StepInputs, hidden: torch.Tensor,
             ids: torch.Tensor | None = None) -> torch.Tensor:
        """One pass over ``inp``'s rows (fed ``ids`` from the device instead of
        ``inp.input_ids`` where given): its graph where one covers it, else eagerly."""
        layer = self.head.layer_for_step(step)
        n = inp.rows.num_decode
        graphs = self.graphs[layer] if self.graphs else None
        if graphs is not None and not inp.rows.chunked and graphs.covers_rows(n):
            self._hidden_in[:n].copy_(hidden)
            return graphs.run(inp, ids)
        return self.head(inp.input_ids if ids is None else ids, hidden, inp.positions,
                         self.caches[layer], inp.meta, self.rope, step=step)

    def _greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's greedy draft, [n] int64 on the device (read back once, after the last
        pass: the passes queue back to back)."""
        return self.head.compute_logits(hidden).argmax(dim=-1)

    def _idle(self, passes: int, first_step: int = 0) -> None:
        """Passes with no rows: under EP each still joins the head's MoE exchange."""
        if self.world_size == 1:
            return
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        h = torch.empty(0, self.head.cfg.hidden_size, device=self.device,
                        dtype=self.head.fc.weight.dtype)
        meta = AttentionMetadata(slot_mapping=empty, query_start_loc=(0,), seq_lens=(),
                                 block_tables=torch.zeros((0, 1), dtype=torch.int32,
                                                          device=self.device),
                                 block_size=self.block_size)
        for step in range(first_step, first_step + passes):
            self.head(empty, h, empty, self.caches[self.head.layer_for_step(step)], meta,
                      self.rope, step=step)
