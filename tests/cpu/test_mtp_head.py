"""The hybrids' MTP head (``epserve.models.mtp``) on tiny checkpoints that ship ``mtp.*`` tensors.

The loader requires every published tensor and names what is wrong; a prompt run through the
head in one pass equals the same rows in chunks and token by token over its own paged KV
(shuffled blocks, garbage everywhere); the head equals the dense definition written from the
published architecture (``tests/mtp_ckpt.py``) for each family and layout; two EP ranks'
expert shards give the whole head; and a head trained for seconds to draft what its target
picks does so through our target's hidden states, one draft and a chained second.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from epserve.kernels.attention import AttentionMetadata
from epserve.models.config import CheckpointError
from epserve.models.layer_cache import KvCacheSpec
from epserve.models.loader import load_model
from epserve.models.mtp import MtpHead, load_mtp_head, mtp_tensor_files
from epserve.models.parallel import ParallelInfo
from fake_ep import LoopbackComm, RecordingComm
from mtp_ckpt import dense_mtp
from tiny_ckpt import SUCC_HI, SUCC_LO, make_tiny_checkpoint

BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS = 4, 64, 8

CASES = {
    "qwen3_next": ("qwen3_next", {}),
    # fused experts in the mtp.* tensors, sharded files, MHA, head_dim 32 (rotary 8)
    "qwen3_5_moe_sharded": ("qwen3_5_moe", dict(sharded=True, num_key_value_heads=4,
                                                 head_dim=32, seed=2)),
    # a multimodal checkpoint: the head's tensors at the top level, tied embeddings
    "qwen3_5_moe_vl_tied": ("qwen3_5_moe_vl", dict(tie_word_embeddings=True, seed=3)),
    # two MTP layers; its top-k weights not renormalised, MQA
    "qwen3_next_two_layers": ("qwen3_next", dict(mtp_layers=2, norm_topk_prob=False,
                                                  num_key_value_heads=1, seed=4)),
}


class Paged:
    """Each sequence's blocks (a shuffled pool), lengths and state slot, as a runner keeps
    them, and one cache per spec filled with garbage that a correct model never reads."""

    def __init__(self, specs, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.caches = []
        for spec in specs:
            if isinstance(spec, KvCacheSpec):
                shape = (NUM_BLOCKS, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
                pair = (torch.empty(shape), torch.empty(shape))
            else:
                pair = spec.allocate(NUM_SLOTS, "cpu")
            for t in pair:
                t.copy_(torch.randn(t.shape, generator=g) * 10)
            self.caches.append(pair)
        self.free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.free_slots = torch.randperm(NUM_SLOTS - 1, generator=g).tolist()
        self.blocks, self.lens, self.slots = {}, {}, {}

    def meta(self, rows: list[tuple[str, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """rows: (sequence, number of new positions). Returns (positions [T], metadata)."""
        pos, slots, qsl, seq_lens, tables, states = [], [], [0], [], [], []
        for name, n in rows:
            start, blocks = self.lens.get(name, 0), self.blocks.setdefault(name, [])
            while len(blocks) * BLOCK_SIZE < start + n:
                blocks.append(self.free.pop())
            pos += range(start, start + n)
            slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                      for p in range(start, start + n)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables.append(blocks)
            if name not in self.slots:
                self.slots[name] = self.free_slots.pop()
            states.append(self.slots[name])
            self.lens[name] = start + n
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return torch.tensor(pos), AttentionMetadata(torch.tensor(slots), tuple(qsl),
                                                    tuple(seq_lens), table, BLOCK_SIZE,
                                                    state_slots=torch.tensor(states))


def _load(path, parallel=ParallelInfo()):
    target, cfg = load_model(path, dtype=torch.float32, device="cpu", parallel=parallel)
    return target, cfg, load_mtp_head(path, cfg, target, dtype=torch.float32, device="cpu",
                                      parallel=parallel)


def _mtp_rows(head, target, paged, rows, step=0):
    """rows: (sequence, ids [n], hidden [n, H]) run through the head in one step. Returns each
    sequence's output hidden [n, H]."""
    pos, meta = paged.meta([(name, len(ids)) for name, ids, _ in rows])
    ids = torch.cat([torch.as_tensor(i) for _, i, _ in rows])
    hidden = torch.cat([h for _, _, h in rows])
    with torch.no_grad():
        out = head(ids, hidden, pos, paged.caches[head.layer_for_step(step)], meta, target.rope,
                   step)
    return {name: out[meta.query_start_loc[i]:meta.query_start_loc[i + 1]]
            for i, (name, _, _) in enumerate(rows)}


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request, tmp_path_factory):
    arch, kwargs = CASES[request.param]
    kwargs = {"mtp_layers": 1, **kwargs}
    return arch, make_tiny_checkpoint(arch, tmp_path_factory.mktemp(request.param), **kwargs)


#: The published checkpoints' names (Qwen3-Next, Qwen3.5), besides the routed experts
PUBLISHED = {f"mtp.{n}.weight" for n in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                         "norm")} | {
    f"mtp.layers.0.{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
        "mlp.gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
        "mlp.shared_expert.down_proj", "mlp.shared_expert_gate")}


def _mtp_tensors(path) -> dict[str, torch.Tensor]:
    files = mtp_tensor_files(path)
    return {n: t for f in files for n, t in load_file(f).items() if n.startswith("mtp.")}


def test_every_published_tensor_is_required_and_a_wrong_one_is_named(ckpt):
    arch, path = ckpt
    target, cfg, head = _load(path)
    tensors = _mtp_tensors(path)
    layer0 = {n for n in tensors
              if not n.startswith("mtp.layers.") or n.startswith("mtp.layers.0.")}
    assert {n for n in layer0 if ".experts." not in n} == PUBLISHED
    h, e = cfg.hidden_size, cfg.num_experts
    assert tensors["mtp.fc.weight"].shape == (h, 2 * h)
    q_rows = 2 * cfg.num_heads * cfg.head_dim  # per head: its query, then its output gate
    assert tensors["mtp.layers.0.self_attn.q_proj.weight"].shape == (q_rows, h)
    assert ({n for n in layer0 if ".experts." in n} == {
        "mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"}
        if arch.startswith("qwen3_5") else len([n for n in layer0 if ".experts." in n]) == 3 * e)
    assert not any(p.requires_grad for p in head.parameters()) and not head.training
    assert head.num_layers == len({n.split(".")[2] for n in tensors if n.startswith("mtp.layers.")})
    # the head owns its weights only: the target's embedding and LM head are shared, not copied
    assert head.embed_tokens is target.embed_tokens and head.lm_head is target.lm_head
    assert all(p is not target.embed_tokens.weight for p in head.parameters())
    fresh = MtpHead(cfg, target.embed_tokens, target.lm_head, head.num_layers)
    for name in tensors:
        with pytest.raises(CheckpointError, match="missing") as err:
            fresh.load_weights((n, t) for n, t in tensors.items() if n != name)
        stem = name.rsplit(".experts.", 1)[0] + ".experts." if ".experts." in name else name
        assert stem in str(err.value)
    name = "mtp.layers.0.self_attn.o_proj.weight"
    with pytest.raises(CheckpointError, match=f"{name}.*shape"):
        fresh.load_weights({**tensors, name: tensors[name][:, 1:]}.items())
    beyond = f"mtp.layers.{head.num_layers}.input_layernorm.weight"
    with pytest.raises(CheckpointError, match=f"{beyond}.*does not exist"):
        fresh.load_weights({**tensors, beyond: tensors["mtp.norm.weight"]}.items())


def test_a_checkpoint_without_an_mtp_head_is_refused(tmp_path):
    path = make_tiny_checkpoint("qwen3_next", tmp_path / "plain")
    target, cfg = load_model(path, dtype=torch.float32, device="cpu")
    with pytest.raises(CheckpointError, match="has no MTP head"):
        load_mtp_head(path, cfg, target, dtype=torch.float32, device="cpu")
    dummy = load_mtp_head(path, cfg, target, dtype=torch.float32, device="cpu",
                          load_format="dummy")
    assert dummy.num_layers == 1 and dummy.fc.weight.abs().sum() > 0


def test_the_config_says_how_many_layers(tmp_path):
    path = make_tiny_checkpoint("qwen3_next", tmp_path / "next", mtp_layers=1)
    target, cfg = load_model(path, dtype=torch.float32, device="cpu")
    config = json.loads((path / "config.json").read_text())
    for fields, match in (({"num_nextn_predict_layers": 2}, "missing .* mtp.layers.1."),
                          ({"num_nextn_predict_layers": 0}, "declares 0 MTP layers"),
                          ({"mtp_use_dedicated_embeddings": True}, "dedicated_embeddings")):
        (path / "config.json").write_text(json.dumps({**config, **fields}))
        with pytest.raises(CheckpointError, match=match):
            load_mtp_head(path, cfg, target, dtype=torch.float32, device="cpu")


def test_one_pass_equals_chunks_and_token_by_token(ckpt):
    """Two ragged sequences: in one step, in chunks beside each other, one row at a time."""
    _, path = ckpt
    target, cfg, head = _load(path)
    g = torch.Generator().manual_seed(7)
    seqs = {name: (torch.randint(3, cfg.vocab_size, (n,), generator=g),
                   torch.randn(n, cfg.hidden_size, generator=g))
            for name, n in (("a", 11), ("b", 6))}
    for step in range(head.num_layers):
        ref = _mtp_rows(head, target, Paged(head.layer_cache_specs(), 1),
                        [(k, ids, h) for k, (ids, h) in seqs.items()], step)
        chunked, paged = {k: [] for k in seqs}, Paged(head.layer_cache_specs(), 2)
        for cuts in (((0, 3), (0, 2)), ((3, 8), (2, 6)), ((8, 11), None)):
            rows = [(k, seqs[k][0][a:b], seqs[k][1][a:b]) for k, c in zip(seqs, cuts) if c
                    for a, b in [c]]
            for k, out in _mtp_rows(head, target, paged, rows, step).items():
                chunked[k].append(out)
        single, paged = {k: [] for k in seqs}, Paged(head.layer_cache_specs(), 3)
        for i in range(11):
            rows = [(k, ids[i:i + 1], h[i:i + 1]) for k, (ids, h) in seqs.items() if i < len(ids)]
            for k, out in _mtp_rows(head, target, paged, rows, step).items():
                single[k].append(out)
        for k in seqs:
            torch.testing.assert_close(torch.cat(chunked[k]), ref[k], atol=1e-5, rtol=0)
            torch.testing.assert_close(torch.cat(single[k]), ref[k], atol=1e-5, rtol=0)


def test_equals_the_dense_definition_of_the_published_head(ckpt):
    """Rows p = 0..L-2 of a prompt: our target's hidden at p (one paged prefill) and the token
    at p + 1, positions p; every layer of the head; hidden and logits within 1e-4."""
    from transformers import AutoConfig

    _, path = ckpt
    target, cfg, head = _load(path)
    tc = AutoConfig.from_pretrained(path).get_text_config()
    weights = {}
    for f in path.glob("*.safetensors"):
        weights.update(load_file(f))
    embed = next(t for n, t in weights.items() if n.endswith("embed_tokens.weight"))
    lm_head = weights.get("lm_head.weight", embed)
    ids = torch.randint(3, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(5))
    paged = Paged(target.layer_cache_specs())
    pos, meta = paged.meta([("s", len(ids))])
    with torch.no_grad():
        hidden = target(ids, pos, paged.caches, meta)  # [L, H] after the final norm
    for step in range(head.num_layers):
        ours = _mtp_rows(head, target, Paged(head.layer_cache_specs(), 4),
                         [("s", ids[1:], hidden[:-1])], step)["s"]
        with torch.no_grad():
            ref = dense_mtp(weights, tc, embed, ids[None, 1:], hidden[None, :-1],
                            torch.arange(len(ids) - 1)[None], layer=step)[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
        torch.testing.assert_close(head.compute_logits(ours), ref @ lm_head.T, atol=1e-4, rtol=0)


def test_two_ep_ranks_expert_shards_give_the_whole_head(tmp_path):
    path = make_tiny_checkpoint("qwen3_5_moe", tmp_path / "ep", mtp_layers=1, seed=5)
    g = torch.Generator().manual_seed(3)
    ids, hidden = torch.randint(3, 320, (9,), generator=g), torch.randn(9, 64, generator=g)

    def run(parallel):
        target, _, head = _load(path, parallel)
        return head, _mtp_rows(head, target, Paged(head.layer_cache_specs()),
                               [("s", ids, hidden)])["s"]

    _, whole = run(ParallelInfo())
    recorder = RecordingComm()
    rank1, _ = run(ParallelInfo(rank=1, world_size=2, ep_comm=recorder))
    assert rank1.layers[0].ffn.routed.experts.w13.shape[0] == 4  # 4 of 8 experts
    _, rank0 = run(ParallelInfo(rank=0, world_size=2, ep_comm=LoopbackComm(recorder.local_fns)))
    torch.testing.assert_close(rank0, whole, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def trained(trained_mtp_ckpt):
    return trained_mtp_ckpt, _load(trained_mtp_ckpt)


def _draft_agreement(target, head) -> tuple[float, float, float]:
    """Held-out prompts (successor chains from random starts, and random tokens), a
    proposer's view: the target prefills the prompt and decodes t_L, t_L+1, t_L+2 greedily;
    the head runs rows 0..L-1 (the target's hidden at p, the token at p + 1) in one pass,
    drafts t_L+1 from its last row and, chained on its own output at position L, t_L+2.
    Returns (the rate of rows whose draft is the target's pick at p + 1, the rate of first
    drafts accepted, the rate of both chained drafts accepted)."""
    g = torch.Generator().manual_seed(11)
    span, rows_ok, rows, first_ok, second_ok, n = SUCC_HI - SUCC_LO, 0, 0, 0, 0, 16
    for i in range(n):
        length = 6 + i % 7
        if i % 4 == 3:  # random tokens: the target still mostly continues with successors
            prompt = torch.randint(SUCC_LO, SUCC_HI, (length,), generator=g)
        else:
            start = int(torch.randint(0, span, (1,), generator=g))
            prompt = SUCC_LO + (start + torch.arange(length)) % span
        tp, hp = Paged(target.layer_cache_specs(), i), Paged(head.layer_cache_specs(), i)
        tokens, hiddens, picks, feed = prompt.tolist(), [], [], prompt
        with torch.no_grad():
            for _ in range(3):
                pos, meta = tp.meta([("s", len(feed))])
                hidden = target(feed, pos, tp.caches, meta)
                hiddens.append(hidden)
                picks += target.compute_logits(hidden).argmax(-1).tolist()
                tokens.append(picks[-1])
                feed = torch.tensor(tokens[-1:])
        hidden = torch.cat(hiddens)  # [L + 2, H]: positions 0..L+1
        out = _mtp_rows(head, target, hp, [("s", torch.tensor(tokens[1:length + 1]),
                                            hidden[:length])])["s"]  # rows 0..L-1
        drafts = head.compute_logits(out).argmax(-1)
        rows_ok += int((drafts[:-1] == torch.tensor(picks[1:length])).sum())
        rows += length - 1
        chained = _mtp_rows(head, target, hp, [("s", drafts[-1:], out[-1:])])["s"]  # position L
        second = int(head.compute_logits(chained).argmax(-1))
        first_ok += int(drafts[-1]) == tokens[length + 1]
        second_ok += int(drafts[-1]) == tokens[length + 1] and second == tokens[length + 2]
    return rows_ok / rows, first_ok / n, second_ok / n


def test_a_trained_head_drafts_what_the_target_picks(trained):
    """Trained for seconds on the target's picks (``make_trained_mtp_checkpoint``), through
    our target's hidden states; a random head of the same checkpoint as the control."""
    path, (target, cfg, head) = trained
    rows, first, both = _draft_agreement(target, head)
    random_head = load_mtp_head(path, cfg, target, dtype=torch.float32, device="cpu",
                                load_format="dummy")
    control = _draft_agreement(target, random_head)
    print(f"trained MTP head: rows agreeing with the target's next pick {rows:.0%}, first "
          f"drafts accepted {first:.0%}, both of two chained {both:.0%}; random head: "
          f"{control[0]:.0%}, {control[1]:.0%}, {control[2]:.0%}")
    assert rows >= 0.9 and first >= 0.9 and both >= 0.75
    assert max(control) <= 0.2
