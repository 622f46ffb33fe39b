"""Our models against Hugging Face transformers (fp32, eager attention) on tiny random checkpoints.

Every logit of every position must match within 1e-4: a whole-batch prefill of ragged
sequences, and a schedule of prefill chunks, mixed prefill/decode steps and decodes over a
paged KV cache with shuffled blocks whose unused slots hold garbage.
"""

from __future__ import annotations

import pytest
import torch

from epserve.kernels.attention import AttentionMetadata
from epserve.models.loader import load_model
from tiny_ckpt import make_tiny_checkpoint

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 48

CASES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_dense_tied": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                               mlp_only_layers=[3], tie_word_embeddings=True,
                                               norm_topk_prob=True)),
    "qwen3_moe_sharded": ("qwen3_moe", dict(sharded=True, seed=1)),
    "mixtral": ("mixtral", {}),
    "mixtral_sliding_window": ("mixtral", dict(sliding_window=6, seed=2)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    arch, kwargs = CASES[request.param]
    path = make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param), **kwargs)
    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    ours, cfg = load_model(path, dtype=torch.float32, device="cpu")
    return hf.eval(), ours, cfg


class PagedRunner:
    """Runs steps of (sequence, new tokens) rows through our model, keeping each sequence's
    blocks (taken from a shuffled pool) and length, like a runner's KV manager would."""

    def __init__(self, model, cfg, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        shape = (NUM_BLOCKS, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.randn(shape, generator=g) * 10, torch.randn(shape, generator=g) * 10)
                   for _ in range(cfg.num_layers)]  # stale garbage a correct kernel never reads
        self.free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.model, self.blocks, self.lens = model, {}, {}

    def step(self, rows: list[tuple[str, list[int]]], pad: int = 0) -> dict[str, torch.Tensor]:
        """rows: (seq name, new token ids). Returns each sequence's logits [n, V] float32."""
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
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
            self.lens[name] = end
        ids, pos, slots = ids + [0] * pad, pos + [0] * pad, slots + [-1] * pad  # padded rows
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        meta = AttentionMetadata(torch.tensor(slots), tuple(qsl), tuple(seq_lens), table, BLOCK_SIZE)
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta)
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape[0] == len(ids)
        return {name: logits[qsl[i]:qsl[i + 1]] for i, (name, _) in enumerate(rows)}


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()  # [L, V]


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def test_prefill_batch_matches_transformers(models):
    hf, ours, cfg = models
    prompts = _prompts(cfg.vocab_size, [5, 11, 8], seed=10)
    runner = PagedRunner(ours, cfg)
    out = runner.step([(f"s{i}", p) for i, p in enumerate(prompts)], pad=3)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out[f"s{i}"], _hf_logits(hf, p), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(models):
    hf, ours, cfg = models
    a, b, c = _prompts(cfg.vocab_size, [9, 14, 6], seed=11)
    runner = PagedRunner(ours, cfg, seed=1)
    seqs = {"a": list(a), "b": list(b), "c": list(c)}
    got: dict[str, list[torch.Tensor]] = {k: [] for k in seqs}

    def run(rows, pad=0):
        for name, logits in runner.step(rows, pad).items():
            got[name].append(logits)

    def decode(name):  # the next input is our own greedy pick from the last logits
        seqs[name].append(int(got[name][-1][-1].argmax()))
        return name, seqs[name][-1:]

    run([("a", a[:4]), ("b", b[:7])])
    run([("a", a[4:]), ("b", b[7:])], pad=2)
    run([decode("a"), decode("b"), ("c", c)])  # decodes and a whole prefill in one step
    run([decode("a"), decode("b"), decode("c")])
    run([decode("c"), decode("a"), decode("b")])
    run([decode("c")])
    for name, tokens in seqs.items():
        assert len(tokens) == {"a": 9, "b": 14, "c": 6}[name] + 3
        mine = torch.cat(got[name])  # [L, V]: one row per position
        ref = _hf_logits(hf, tokens)
        torch.testing.assert_close(mine, ref, atol=ATOL, rtol=0)
        picks = tokens[-3:]
        assert picks == ref[-4:-1].argmax(-1).tolist()  # greedy agrees with transformers
