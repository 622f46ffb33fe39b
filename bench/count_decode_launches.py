"""Count what one batch-1 decode forward of a gated-DeltaNet hybrid launches, per layer kind:
torch ops dispatched (the ones that launch a kernel on CUDA, copies among them) and Triton
kernel launches. Counted, not timed: it runs on CPU with ``TRITON_INTERPRET=1`` forced on, so
the model takes the CUDA path (every op whose Triton kernel covers it runs that kernel, in the
interpreter) exactly as a decode CUDA graph captures it (``worker/cuda_graphs.py``: one row,
device lengths, a state slot per row).

    python bench/count_decode_launches.py [--arch qwen3.5 qwen3-next] [--dtype bfloat16] [--ops]
    python bench/count_decode_launches.py --batch 4  # a larger rung
    python bench/count_decode_launches.py --verify 3  # a speculative verify (eager) + its fold

Torch ops are counted with a ``TorchDispatchMode`` (aten ops, as the profiler sees them);
those that launch nothing on a GPU (views, ``empty``) are listed apart. Triton launches are
counted by wrapping the interpreter's kernel launch; the torch ops the interpreter itself runs
to move arguments are not counted. Each op is charged to the layer (and its part: the input
norm, the token mixer, the feed-forward) whose forward it ran in; ``model`` is the rest
(embedding, final norm, what a step computes once for all its layers). A host sync (``_local_scalar_dense``) would break a CUDA graph: it is
counted too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton module is imported

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: aten ops that launch no kernel on a GPU (metadata, allocation).
NO_KERNEL = frozenset("""view _unsafe_view slice select split split_with_sizes unbind narrow
as_strided t transpose permute unsqueeze squeeze expand detach alias empty empty_like empty_strided detach_
new_empty new_empty_strided lift_fresh _reshape_alias view_as_real view_as_complex
unflatten reshape(view) to(view) contiguous(view) flatten(view) type_as(view)""".split())
#: aten ops that copy memory (a launch each): what ``.contiguous()``, ``.clone()``,
#: ``torch.cat``, ``.to(dtype)`` and ``copy_`` dispatch.
COPIES = frozenset("""copy_ clone cat _to_copy index_put_ index masked_fill reshape(copy)
to(copy) contiguous(copy) flatten(copy) type_as(copy)""".split())
SYNCS = frozenset("_local_scalar_dense item".split())
#: composite ops that copy or not depending on their input (counted by what they did)
MAYBE_COPY = frozenset("reshape to contiguous flatten type_as".split())

TINY = dict(vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False)
ARCHS = {
    "qwen3.5": dict(TINY, architectures=["Qwen3_5MoeForCausalLM"],
                    model_type="qwen3_5_moe_text"),
    "qwen3-next": dict(TINY, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next",
                       intermediate_size=96, norm_topk_prob=True, decoder_sparse_step=1,
                       mlp_only_layers=[]),
}


class Counts:
    """Per (layer, part): torch ops by name, and Triton launches by kernel name."""

    def __init__(self):
        self.where = ["model"]  # stack of "layer i/part" labels
        self.in_kernel = 0
        self.torch: dict[str, Counter] = defaultdict(Counter)
        self.triton: dict[str, Counter] = defaultdict(Counter)


class _Mode(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.c = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.c.in_kernel:
            self.c.torch[self.c.where[-1]][_name(func, args, out)] += 1
        return out


def _name(func, args, out) -> str:
    """The op's name; a composite op that may or may not copy (``reshape``, ``to``,
    ``contiguous``) is named by what it did: ``reshape(view)`` launches nothing."""
    name = func.overloadpacket.__name__
    if name in MAYBE_COPY and isinstance(out, torch.Tensor) and args \
            and isinstance(args[0], torch.Tensor):
        same = out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
        return f"{name}(view)" if same else f"{name}(copy)"
    return name


def _wrap_triton_launch(counts: Counts) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            counts.triton[counts.where[-1]][self.fn.__name__] += 1
        counts.in_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counts.in_kernel -= 1

    InterpretedFunction.run = counted


def _hook(module: torch.nn.Module, label: str, counts: Counts) -> None:
    def enter(*_):
        counts.where.append(label)

    def leave(*_):  # returns None: the module's output is kept
        counts.where.pop()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _labelled(fn, label: str, counts: Counts):
    def call(*args, **kwargs):
        counts.where.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            counts.where.pop()

    return call


def _layer_kind(model, i: int) -> str:
    from epserve.models.gated_deltanet import GatedDeltaNet

    layer = model.layers[i]
    kind = "deltanet" if isinstance(layer.mixer, GatedDeltaNet) else "attention"
    return kind + ("" if hasattr(layer.ffn, "routed") else "+dense")


def build(arch: str, dtype: torch.dtype, batch: int = 1, verify: int = 0):
    """The tiny model of ``arch`` (dummy weights), its caches and a decode step's inputs of
    ``batch`` rows as ``DecodeGraphs`` gives them (device lengths, a state slot per row); with
    ``verify`` = k, a speculative verify's instead: each sequence k + 1 tokens, held."""
    from epserve.kernels.attention import AttentionMetadata, StateRuns
    from epserve.models.layer_cache import KvCacheSpec
    from epserve.models.loader import load_model

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(ARCHS[arch]))
    model, cfg = load_model(folder, dtype=dtype, device="cpu", load_format="dummy")
    block_size, seq_len = 16, 9
    caches = []
    for spec in model.layer_cache_specs():
        if isinstance(spec, KvCacheSpec):
            shape = (2 * batch, block_size, spec.num_kv_heads, spec.head_dim)
            caches.append(tuple(torch.randn(shape).to(dtype) * 0.1 for _ in range(2)))
        else:
            conv, rec = spec.allocate(batch + 1, "cpu")
            caches.append((conv.normal_(0, 0.1), rec.normal_(0, 0.1)))

    if verify:
        n = verify + 1

        def meta():  # each position a one-token row; each sequence's k + 1 one held run
            tok = torch.arange(n)
            return AttentionMetadata(
                slot_mapping=torch.cat([b * 2 * block_size + seq_len - 1 + tok
                                        for b in range(batch)]),
                query_start_loc=tuple(range(batch * n + 1)),
                seq_lens=tuple(seq_len + i for _ in range(batch) for i in range(n)),
                block_tables=torch.arange(2 * batch, dtype=torch.int32).view(
                    batch, 2).repeat_interleave(n, 0),
                block_size=block_size, seq_lens_t=torch.tensor(
                    [seq_len + i for _ in range(batch) for i in range(n)], dtype=torch.int32),
                state_slots=(torch.arange(batch) + 1).repeat_interleave(n),
                state_runs=StateRuns(tuple(range(0, batch * n + 1, n)), range(1, batch + 1),
                                     [False] * batch, tuple(range(batch))))

        ids = torch.arange(batch * n) + 7
        pos = (seq_len - 1 + torch.arange(n)).repeat(batch)
        return model, caches, meta, ids, pos

    def meta():  # a new one per forward: what a step computes once is counted once
        return AttentionMetadata(
            slot_mapping=torch.arange(batch) * 2 * block_size + seq_len - 1,
            query_start_loc=tuple(range(batch + 1)), seq_lens=(1,) * batch,
            block_tables=torch.arange(2 * batch, dtype=torch.int32).view(batch, 2),
            block_size=block_size, seq_lens_t=torch.full((batch,), seq_len, dtype=torch.int32),
            state_slots=torch.arange(batch) + 1)

    ids, pos = torch.arange(batch) + 7, torch.full((batch,), seq_len - 1)
    return model, caches, meta, ids, pos


def count(arch: str, dtype: torch.dtype, batch: int = 1,
          verify: int = 0) -> tuple[Counts, list[str]]:
    model, caches, meta, ids, pos = build(arch, dtype, batch, verify)
    counts = Counts()
    kinds = []
    import epserve.models.gated_deltanet as gdn

    # a step's fresh-sequence mask is computed once for all its DeltaNet layers: the model's
    gdn.fresh_sequences = _labelled(gdn.fresh_sequences, "model", counts)
    for i, layer in enumerate(model.layers):
        kinds.append(_layer_kind(model, i))
        _hook(layer, f"{i}/glue", counts)
        for name, child in layer.named_children():
            _hook(child, f"{i}/{name}", counts)
        prenorm = getattr(layer.ffn, "forward_prenorm", None)
        if prenorm is not None:  # the block calls it instead of the ffn's forward
            layer.ffn.forward_prenorm = _labelled(prenorm, f"{i}/ffn", counts)
        for name, child in layer.ffn.named_children():
            _hook(child, f"{i}/ffn.{name}", counts)
        if hasattr(layer.mixer, "fold"):  # a verify's fold, charged to its layer
            layer.mixer.fold = _labelled(layer.mixer.fold, f"{i}/fold", counts)
    with torch.inference_mode():
        model(ids, pos, caches, meta())  # warm-up: Triton's first launch of each kernel
        _wrap_triton_launch(counts)
        counts.torch.clear()
        step = meta()
        with _Mode(counts):
            model(ids, pos, caches, step)
            if verify:  # every draft accepted: each held state advanced by k + 1 tokens
                model.fold_held_states(caches, step, [verify + 1] * batch)
    return counts, kinds


def _split(ops: Counter) -> tuple[int, int, int, int]:
    """(launching ops, copies among them, no-kernel ops, host syncs)."""
    launch = sum(n for op, n in ops.items() if op not in NO_KERNEL)
    copies = sum(n for op, n in ops.items() if op in COPIES)
    return (launch, copies, sum(n for op, n in ops.items() if op in NO_KERNEL),
            sum(n for op, n in ops.items() if op in SYNCS))


def _ops(parts: Counter) -> Counter:
    """{(part, op): n} summed over parts: {op: n}."""
    out: Counter = Counter()
    for (_, op), c in parts.items():
        out[op] += c
    return out


def report(arch: str, counts: Counts, kinds: list[str], show_ops: bool, batch: int = 1,
           verify: int = 0) -> None:
    by_kind: dict[str, list] = defaultdict(lambda: [0, Counter(), Counter()])
    for where in set(counts.torch) | set(counts.triton):
        idx = where.split("/")[0]
        kind = "model" if idx == "model" else kinds[int(idx)]
        part = "" if idx == "model" else where.split("/")[1]
        entry = by_kind[kind]
        entry[1].update({(part, op): n for op, n in counts.torch[where].items()})
        entry[2].update({(part, k): n for k, n in counts.triton[where].items()})
    for k in kinds:
        by_kind[k][0] += 1
    by_kind["model"][0] = 1
    order = sorted(by_kind, key=lambda k: (k == "model", k))
    what = (f"a verify of {verify} drafts for {batch} sequence(s) and its fold" if verify
            else f"one batch-{batch} decode forward")
    print(f"\n{arch}: {what} ({len(kinds)} layers), per layer of each kind")
    print("| layer kind | layers | torch launches | of which copies | Triton launches | "
          "launches | no-kernel torch ops | host syncs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    total, per = 0, {}
    for kind in order:
        n, ops, tri = by_kind[kind]
        launch, copies, views, syncs = _split(_ops(ops))
        trit = sum(tri.values())
        total += launch + trit
        per[kind] = (launch + trit) / n
        print(f"| {kind} | {n} | {launch / n:.2f} | {copies / n:.2f} | {trit / n:.2f} | "
              f"{per[kind]:.2f} | {views / n:.2f} | {syncs / n:.2f} |")
    print(f"total launches of the forward: {total}")
    if {"deltanet", "attention", "model"} <= set(per):  # the 35B-A3B pattern, per step
        full = 30 * per["deltanet"] + 10 * per["attention"] + per["model"]
        print(f"at the Qwen3.5-35B-A3B pattern (30 DeltaNet + 10 attention layers): "
              f"{full:.0f} launches a {'verify and its fold' if verify else 'decode step'}")
    if not show_ops:
        return
    for kind in order:
        n, ops, tri = by_kind[kind]
        print(f"\n{kind} (per layer):")
        for (part, op), c in sorted(ops.items()):
            if op not in NO_KERNEL:
                print(f"  torch  {part or '-':<24} {op:<28} {c / n:g}")
        for (part, k), c in sorted(tri.items()):
            print(f"  triton {part or '-':<24} {k:<28} {c / n:g}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", choices=sorted(ARCHS), default=["qwen3.5", "qwen3-next"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--ops", action="store_true", help="list every op and kernel per part")
    ap.add_argument("--batch", type=int, default=1, help="decode rows (a CUDA graph's rung)")
    ap.add_argument("--verify", type=int, default=0, metavar="K",
                    help="count a speculative verify of K drafts a sequence and its fold instead")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    for arch in args.arch:
        counts, kinds = count(arch, getattr(torch, args.dtype), args.batch, args.verify)
        report(arch, counts, kinds, args.ops, args.batch, args.verify)
    return 0


if __name__ == "__main__":
    sys.exit(main())
