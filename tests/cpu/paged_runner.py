"""A hand-built runner for model tests: each layer's cache allocated from the model's
``layer_cache_specs`` (a paged KV cache with shuffled blocks, or per-slot DeltaNet states), all
of it filled with garbage a correct model never reads, and steps of (sequence, new tokens)
rows run through ``forward`` with the metadata a real runner would build."""

from __future__ import annotations

import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.layer_cache import KvCacheSpec

BLOCK_SIZE = 4
NUM_BLOCKS = 64
NUM_STATE_SLOTS = 8  # the last one is the spare slot padded rows point at


class PagedRunner:
    """Keeps each sequence's blocks (from a shuffled pool), length and state slot (from a
    shuffled list), like a runner's KV and state managers would."""

    def __init__(self, model, cfg, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.caches = []
        for spec in model.layer_cache_specs():
            if isinstance(spec, KvCacheSpec):
                shape = (NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
                pair = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
            else:
                pair = spec.allocate(NUM_STATE_SLOTS, "cpu")
            for t in pair:  # stale garbage
                t.copy_(torch.randn(t.shape, generator=g) * 10)
            self.caches.append(pair)
        self.free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.spare_slot = NUM_STATE_SLOTS - 1
        self.free_slots = torch.randperm(NUM_STATE_SLOTS - 1, generator=g).tolist()
        self.model, self.blocks, self.lens, self.slots = model, {}, {}, {}

    def step(self, rows: list[tuple[str, list[int]]], pad: int = 0,
             pad_seqs: int = 0) -> dict[str, torch.Tensor]:
        """rows: (seq name, new token ids). ``pad`` adds padding rows past the last sequence;
        ``pad_seqs`` adds padded one-row sequences (length 1, KV slot -1, the spare state
        slot), as a CUDA graph's padded decode rows. Returns each sequence's logits [n, V]."""
        ids, pos, slots, qsl, seq_lens, tables, states = [], [], [], [0], [], [], []
        for name, toks in rows:
            start = self.lens.get(name, 0)
            blocks = self.blocks.setdefault(name, [])
            end = start + len(toks)
            while len(blocks) * BLOCK_SIZE < end:
                blocks.append(self.free.pop())
            ids += toks
            pos += range(start, end)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(end)
            tables.append(blocks)
            if name not in self.slots:
                self.slots[name] = self.free_slots.pop()
            states.append(self.slots[name])
            self.lens[name] = end
        for _ in range(pad_seqs):
            ids, pos, slots = ids + [0], pos + [0], slots + [-1]
            qsl.append(qsl[-1] + 1)
            seq_lens.append(1)
            tables.append([0])
            states.append(self.spare_slot)
        ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad  # padded rows
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        meta = AttentionMetadata(torch.tensor(slots), tuple(qsl), tuple(seq_lens), table,
                                 BLOCK_SIZE, state_slots=torch.tensor(states))
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.caches, meta)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape[0] == len(ids)
        return {name: logits[qsl[i]:qsl[i + 1]] for i, (name, _) in enumerate(rows)}


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """transformers' logits of every position of one sequence: [L, V] float32."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


class Schedule:
    """Sequences stepped through a ``PagedRunner``: each one's tokens so far (prompt, then
    our greedy picks) and our logits of every position, to hold against transformers'."""

    def __init__(self, runner: PagedRunner, seqs: dict[str, list[int]]):
        self.runner, self.prompts = runner, {k: list(v) for k, v in seqs.items()}
        self.tokens = {k: list(v) for k, v in seqs.items()}
        self.logits: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}

    def run(self, rows: list[tuple[str, list[int]]], pad: int = 0) -> None:
        for name, logits in self.runner.step(rows, pad).items():
            self.logits[name].append(logits)

    def decode(self, name: str) -> tuple[str, list[int]]:
        """A decode row feeding our own greedy pick from the sequence's last logits."""
        self.tokens[name].append(int(self.logits[name][-1][-1].argmax()))
        return name, self.tokens[name][-1:]

    def check(self, hf, atol: float) -> None:
        """Every position's logits within ``atol`` of transformers' on the whole sequence, and
        every pick what transformers would pick."""
        for name, tokens in self.tokens.items():
            ref = hf_logits(hf, tokens)
            torch.testing.assert_close(torch.cat(self.logits[name]), ref, atol=atol, rtol=0)
            n = len(tokens) - len(self.prompts[name])
            assert n > 0 and tokens[-n:] == ref[-n - 1:-1].argmax(-1).tolist()
