"""The hybrids' MTP head for tests: a plain dense torch definition of it, random ``mtp.*``
tensors with the published names and shapes for a tiny checkpoint (``make_tiny_checkpoint(...,
mtp_layers=n)``), and a tiny checkpoint whose head was trained for seconds on CPU to draft what
its target picks.

``dense_mtp`` is written from the published architecture (the checkpoints' ``mtp.*`` tensors as
vLLM and SGLang run them), over the checkpoint's own tensor names and transformers' config, with
nothing of epserve: it is the test oracle of ``epserve.models.mtp`` and the module the trainer
differentiates. A row pairs the target's hidden at position p (after its final norm) with the
token at p + 1 and runs at position p; it drafts the token at p + 2.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from tiny_ckpt import HYBRID_ARCHS, SUCC_HI, SUCC_LO, make_trained_checkpoint


def zc_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: the weight is applied as ``1 + w``."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + w.float())).to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """Rotate the first ``rot`` dims of each head (halves, not interleaved). x: [B, T, heads, D];
    positions: [B, T]."""
    inv = 1.0 / theta ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)  # [rot/2]
    ang = positions.float()[..., None] * inv  # [B, T, rot/2]
    ang = torch.cat([ang, ang], -1)[:, :, None]  # [B, T, 1, rot]
    cos, sin = ang.cos(), ang.sin()
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr[..., :rot // 2], xr[..., rot // 2:]
    rotated = xr * cos + torch.cat([-x2, x1], -1) * sin
    return torch.cat([rotated, xp], -1)


def _expert_weights(w: dict, p: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's (gate [I, H], up [I, H], down [H, I]), per-expert or fused names."""
    if f"{p}.experts.gate_up_proj" in w:
        gate, up = w[f"{p}.experts.gate_up_proj"][e].chunk(2, dim=0)
        return gate, up, w[f"{p}.experts.down_proj"][e]
    return tuple(w[f"{p}.experts.{e}.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj"))


def _swiglu(x, gate, up, down):
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _ffn(w: dict, p: str, x: torch.Tensor, tc) -> torch.Tensor:
    """x: [N, H]. The MoE with its gated shared expert, or a dense SwiGLU MLP."""
    if f"{p}.gate.weight" not in w:
        return _swiglu(x, w[f"{p}.gate_proj.weight"], w[f"{p}.up_proj.weight"],
                       w[f"{p}.down_proj.weight"])
    probs = F.linear(x, w[f"{p}.gate.weight"]).float().softmax(-1)  # [N, E]
    top_w, top_i = probs.topk(tc.num_experts_per_tok, dim=-1)
    if getattr(tc, "norm_topk_prob", True):
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(tc.num_experts):
        weight = (top_w * (top_i == e)).sum(-1).to(x.dtype)  # [N]
        out = out + weight[:, None] * _swiglu(x, *_expert_weights(w, p, e))
    shared = _swiglu(x, *(w[f"{p}.shared_expert.{n}.weight"] for n in ("gate_proj", "up_proj",
                                                                        "down_proj")))
    return out + torch.sigmoid(F.linear(x, w[f"{p}.shared_expert_gate.weight"])) * shared


def _attention(w: dict, p: str, x: torch.Tensor, positions: torch.Tensor, tc) -> torch.Tensor:
    """Gated full attention over rows in order (causal). x: [B, T, H]."""
    b, t, _ = x.shape
    hq, hkv, d = tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    eps = tc.rms_norm_eps
    qg = F.linear(x, w[f"{p}.q_proj.weight"]).view(b, t, hq, 2 * d)  # per head: query, gate
    q, gate = qg[..., :d], qg[..., d:].reshape(b, t, hq * d)
    k = F.linear(x, w[f"{p}.k_proj.weight"]).view(b, t, hkv, d)
    v = F.linear(x, w[f"{p}.v_proj.weight"]).view(b, t, hkv, d)
    q, k = zc_norm(q, w[f"{p}.q_norm.weight"], eps), zc_norm(k, w[f"{p}.k_norm.weight"], eps)
    params = getattr(tc, "rope_parameters", None) or {}
    rot = int(d * params.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", 0.25)))
    theta = params.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    q, k = _rope(q, positions, rot, theta), _rope(k, positions, rot, theta)
    k, v = (z.repeat_interleave(hq // hkv, dim=2) for z in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * d ** -0.5
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(x.dtype).reshape(b, t, hq * d)
    return F.linear(out * torch.sigmoid(gate), w[f"{p}.o_proj.weight"])


def dense_mtp(w: dict, tc, embed: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor,
              positions: torch.Tensor, layer: int = 0) -> torch.Tensor:
    """The MTP head over whole sequences: w, the checkpoint's ``mtp.*`` tensors by name; tc,
    transformers' (text) config; embed: the target's embedding [V, H]; ids [B, T] (the token at
    p + 1), hidden [B, T, H] (the target's at p, after its final norm), positions [B, T] (p).
    Returns the head's hidden after ``mtp.norm`` [B, T, H] (the target's lm_head gives logits)."""
    eps = tc.rms_norm_eps
    e = zc_norm(F.embedding(ids, embed), w["mtp.pre_fc_norm_embedding.weight"], eps)
    h = zc_norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)
    x = F.linear(torch.cat([e, h], -1), w["mtp.fc.weight"])  # [B, T, H]
    p = f"mtp.layers.{layer}"
    x = x + _attention(w, f"{p}.self_attn", zc_norm(x, w[f"{p}.input_layernorm.weight"], eps),
                       positions, tc)
    normed = zc_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
    x = x + _ffn(w, f"{p}.mlp", normed.reshape(-1, x.shape[-1]), tc).view_as(x)
    return zc_norm(x, w["mtp.norm.weight"], eps)


# --------------------------------------------------------------------------- mtp.* tensors

_QWEN3_5 = ("qwen3_5_moe", "qwen3_5_moe_vl")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _saved_shapes(out: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def mtp_shapes(arch: str, out: str | Path, num_layers: int) -> dict[str, tuple[int, ...]]:
    """The published ``mtp.*`` tensor names and shapes of ``num_layers`` MTP layers for the
    checkpoint saved at ``out``: ``fc`` [H, 2H], the two pre-fc norms and the final norm [H],
    and per layer the names of one of the target's full-attention blocks under
    ``mtp.layers.{i}.`` (its feed-forward MoE unless the target's rule makes layer i dense).
    Qwen3.5's routed experts come fused (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) as its checkpoints ship them; Qwen3-Next's per expert."""
    out = Path(out)
    text = json.loads((out / "config.json").read_text())
    text = text.get("text_config", text)
    shapes = _saved_shapes(out)
    prefix = next(p for p in ("model.language_model.layers.", "model.layers.")
                  if any(n.startswith(p) for n in shapes))
    layers: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        if name.startswith(prefix):
            idx, rest = name[len(prefix):].split(".", 1)
            layers.setdefault(int(idx), {})[rest] = shape
    full = next(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    h = text["hidden_size"]
    result = {f"mtp.{n}.weight": (h,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                 "norm")}
    result["mtp.fc.weight"] = (h, 2 * h)
    for i in range(num_layers):
        moe = (i not in (text.get("mlp_only_layers") or [])
               and (i + 1) % (text.get("decoder_sparse_step") or 1) == 0)
        ffn_src = next(j for j in sorted(layers) if ("mlp.gate.weight" in layers[j]) == moe)
        block = {n: s for n, s in layers[full].items() if not n.startswith("mlp.")}
        block.update({n: s for n, s in layers[ffn_src].items() if n.startswith("mlp.")})
        experts = {n: s for n, s in block.items() if _EXPERT_RE.match(n)}
        if arch in _QWEN3_5 and experts:
            for n in experts:
                del block[n]
            e = 1 + max(int(_EXPERT_RE.match(n).group(1)) for n in experts)
            i_size, h_size = experts["mlp.experts.0.gate_proj.weight"]
            block["mlp.experts.gate_up_proj"] = (e, 2 * i_size, h_size)
            block["mlp.experts.down_proj"] = (e, h_size, i_size)
        result.update({f"mtp.layers.{i}.{n}": s for n, s in block.items()})
    return result


def add_tensors(out: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Add ``tensors`` to the checkpoint at ``out``: into ``model.safetensors``, or for a
    sharded one into a new shard named in the index."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        save_file(tensors, out / "model-mtp.safetensors", metadata={"format": "pt"})
        data["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
        index.write_text(json.dumps(data, indent=2))
        return
    merged = {**load_file(out / "model.safetensors"), **tensors}
    save_file(merged, out / "model.safetensors", metadata={"format": "pt"})


def declare_mtp_layers(arch: str, out: str | Path, num_layers: int) -> None:
    """Qwen3.5 declares its MTP layers in ``mtp_num_hidden_layers`` (in ``text_config`` when
    multimodal); Qwen3-Next's published configs do not declare them (the loader counts them)."""
    if arch not in _QWEN3_5:
        return
    path = Path(out) / "config.json"
    d = json.loads(path.read_text())
    (d["text_config"] if "text_config" in d else d)["mtp_num_hidden_layers"] = num_layers
    path.write_text(json.dumps(d, indent=2))


def random_mtp_tensors(arch: str, out: str | Path, num_layers: int, *, seed: int = 0,
                       std: float = 0.1) -> dict[str, torch.Tensor]:
    """Random ``mtp.*`` tensors (``mtp_shapes``) in the checkpoint's dtype: N(0, std) matrices,
    zero-centred norm weights jittered off 0 (N(0, 0.3)), as the hybrids' other norms."""
    cfg = json.loads((Path(out) / "config.json").read_text())
    dtype = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
    g = torch.Generator().manual_seed(10_000 + seed)
    tensors = {}
    for name, shape in sorted(mtp_shapes(arch, out, num_layers).items()):
        scale = 0.3 if name.endswith("norm.weight") else std
        tensors[name] = (torch.randn(shape, generator=g) * scale).to(dtype)
    return tensors


def add_random_mtp_head(arch: str, out: str | Path, num_layers: int, *, seed: int = 0) -> None:
    """Give the hybrid checkpoint at ``out`` a random MTP head of ``num_layers`` layers."""
    if arch not in HYBRID_ARCHS:
        raise ValueError(f"MTP heads exist for {HYBRID_ARCHS}, not {arch!r}")
    add_tensors(out, random_mtp_tensors(arch, out, num_layers, seed=seed))
    declare_mtp_layers(arch, out, num_layers)


# --------------------------------------------------------------------------- the trained head


def target_outputs(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' target over ids [B, T]: (hidden after the final norm [B, T, H], its
    greedy picks [B, T])."""
    out = hf.model(input_ids=ids)
    hidden = out.last_hidden_state
    return hidden, hf.lm_head(hidden).argmax(-1)


def make_trained_mtp_checkpoint(arch: str, out_dir: str | Path, *, target_steps: int = 60,
                                mtp_steps: int = 80, seed: int = 0) -> Path:
    """A tiny hybrid (one DeltaNet layer, one full-attention layer, fp32) trained for
    ``target_steps`` to follow the successor chain (``make_trained_checkpoint``), then its MTP
    head trained alone for ``mtp_steps`` Adam steps, the target frozen, so that row p (the
    target's hidden at p, the token at p + 1) predicts the target's greedy pick at p + 1.
    Seconds on CPU; deterministic for a given ``seed``. Returns the folder."""
    from transformers import AutoModelForCausalLM

    out = make_trained_checkpoint(arch, out_dir, steps=target_steps, seed=seed,
                                  dtype=torch.float32, num_hidden_layers=2,
                                  layer_types=["linear_attention", "full_attention"])
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        hf.requires_grad_(False)
        tc = hf.config.get_text_config()
        w = {n: t.clone().requires_grad_(True)
             for n, t in random_mtp_tensors(arch, out, 1, seed=seed, std=0.02).items()}
        opt = torch.optim.AdamW(list(w.values()), lr=3e-3, weight_decay=0.0)
        span, embed = SUCC_HI - SUCC_LO, hf.get_input_embeddings().weight
        chains = SUCC_LO + (torch.arange(span)[:, None] + torch.arange(16)) % span  # [span, 16]
        with torch.no_grad():  # the target's outputs on every chain, once
            all_hidden, all_picks = target_outputs(hf, chains)
        pos = torch.arange(15).expand(32, 15)
        for _ in range(mtp_steps):
            batch = torch.randint(0, span, (32,))
            ids, hidden, picks = chains[batch], all_hidden[batch], all_picks[batch]
            mtp_hidden = dense_mtp(w, tc, embed, ids[:, 1:], hidden[:, :-1], pos)
            loss = F.cross_entropy(hf.lm_head(mtp_hidden).flatten(0, 1), picks[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.random.set_rng_state(rng_state)
    add_tensors(out, {n: t.detach().contiguous() for n, t in w.items()})
    declare_mtp_layers(arch, out, 1)
    return out
