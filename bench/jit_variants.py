"""Which Triton kernel variants a serving workload compiles after start-up, counted on CPU.

Triton compiles a kernel once per *specialization*: its constexprs, its launch options, and for
every other argument its type and class (an integer equal to 1, divisible by 16, or neither; a
tensor's dtype and whether its address is 16-byte aligned). A variant first met while serving
compiles inside a request's step (about a second on the H200), so what the start-up does not
compile, the first requests pay. This tool runs the engine on CPU with ``TRITON_INTERPRET=1``
(every op whose Triton kernel covers it runs that kernel, in the interpreter), records each
launch's specialization key as Triton 3.x computes it (``native_specialize_impl``), and prints
per kernel the variants the start-up compiled (the prefill warm-up, then every decode graph
rung run once) and those the workload met anew. Pure decode forwards are not recorded: on the
GPU they replay the decode graphs, compiled at start.

    python bench/jit_variants.py [--prompts 24] [--budget 256] [--max-tokens 6] [--speculative K]

Counted, not timed; a tiny random Qwen3-MoE, or with ``--arch qwen3.5`` a Qwen3.5-MoE hybrid (dims
multiples of 16, as the real shapes', so the classes of the shape-derived arguments match
theirs; fla-core's prefill kernels, CUDA only, are not seen).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton module is imported

import torch  # noqa: E402

TINY = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512,
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_experts=8, num_experts_per_tok=2, max_position_embeddings=4096,
            rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=True,
            tie_word_embeddings=False, torch_dtype="bfloat16")
#: a tiny Qwen3.5-MoE hybrid (3 gated-DeltaNet layers + 1 gated attention, a shared expert)
HYBRID = dict(TINY, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4,
              shared_expert_intermediate_size=48, num_hidden_layers=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"])
ARCHS = {"qwen3": TINY, "qwen3.5": HYBRID}
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class Variants:
    """Specialization keys seen per kernel, by phase, with one example launch's int values."""

    def __init__(self):
        self.phase = "start"
        self.paused = 0
        self.seen: dict[str, dict[str, dict[tuple, dict]]] = defaultdict(lambda: defaultdict(dict))

    def record(self, fn, args, kwargs) -> None:
        if self.paused:
            return
        key, ints = specialization(fn, args, kwargs)
        name = fn.fn.__name__
        if not any(key in self.seen[p][name] for p in self.seen):
            self.seen[self.phase][name][key] = ints

    def new(self, phase: str) -> dict[str, dict[tuple, dict]]:
        return self.seen.get(phase, {})


def specialization(fn, args, kwargs) -> tuple[tuple, dict]:
    """Triton's cache key of one launch of interpreted kernel ``fn`` (its params'
    specializations and the launch options), and the launch's int arguments by name."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    params = inspect.signature(fn.fn).parameters
    names = list(params)
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    for k, p in params.items():
        if k not in bound and p.default is not inspect.Parameter.empty:
            bound[k] = p.default
    dns = set(fn.kwargs.get("do_not_specialize", ()) or ())
    dns |= {names[i] for i in list(dns) if isinstance(i, int)}
    key, ints = [], {}
    for k in names:
        v = bound.get(k)
        if "constexpr" in str(params[k].annotation):
            key.append((k, "constexpr", v))
            continue
        spec = native_specialize_impl(BaseBackend, v, False, k not in dns, True)
        key.append((k, spec[0], spec[1]))
        if isinstance(v, int) and not isinstance(v, bool):
            ints[k] = v
    key.append(tuple((o, kwargs.get(o)) for o in LAUNCH_OPTIONS))
    return tuple(key), ints


def _install(variants: Variants) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        if not kwargs.get("warmup"):
            variants.record(self, args, kwargs)
        variants.paused += 1  # kernels a kernel's launch wrapper runs are its own business
        try:
            return run(self, *args, **kwargs)
        finally:
            variants.paused -= 1

    InterpretedFunction.run = recorded


def start_up(llm) -> None:
    """What a CUDA runner compiles at start (``Runner.__init__``): its warm-up, then every
    decode graph rung's eager forward, here on the CPU runner's model and caches."""
    from epserve.worker.cuda_graphs import DecodeGraphs

    r = llm.model.runner
    r.warm_up()
    graphs = DecodeGraphs(r._forward, r.device, r.block_size, r.cfg.max_num_seqs,
                          r.tables.max_blocks_per_seq, r.spare_state_slot)
    with torch.inference_mode():
        for b in graphs.rungs:
            graphs.forward(graphs.input_ids[:b], graphs.positions[:b], graphs._meta(b))


def _skip_pure_decode(runner, variants: Variants) -> None:
    """Pure decode forwards (every row one token) replay graphs on the GPU: not recorded."""
    forward = runner._forward

    def forward_unless_decode(input_ids, positions, meta):
        pure = len(meta.query_start_loc) - 1 == input_ids.shape[0]
        variants.paused += pure
        try:
            return forward(input_ids, positions, meta)
        finally:
            variants.paused -= pure

    runner._forward = forward_unless_decode


def run(prompts: int, budget: int, max_tokens: int, seed: int = 0, experts: int = 8,
        top_k: int = 2, max_num_seqs: int = 64, max_prompt: int = 90, burst: int = 8,
        arch: str = "qwen3", speculative: int = 0) -> Variants:
    from epserve import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(
        dict(ARCHS[arch], num_experts=experts, num_experts_per_tok=top_k)))
    variants = Variants()
    _install(variants)
    llm = LLM(model=str(folder), load_format="dummy", device="cpu", dtype="bfloat16",
              max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, max_model_len=1024,
              enable_prefix_caching=False, seed=seed,
              speculative_config=None if not speculative else {
                  "method": "ngram", "num_speculative_tokens": speculative,
                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    variants.seen.clear()  # the CPU engine's own start-up (no warm-up there) is not the GPU's
    start_up(llm)
    variants.phase = "workload"
    _skip_pure_decode(llm.model.runner, variants)
    rng = random.Random(seed)
    work = [{"prompt_token_ids": [rng.randrange(3, 500)
                                  for _ in range(rng.randrange(8, max_prompt))]}
            for _ in range(prompts)]
    # greedy and random rows, some with logprobs, some banning 1-4 stop ids under min_tokens,
    # penalties, a logit bias, prompt logprobs
    extra = [{}, dict(presence_penalty=0.5, repetition_penalty=1.1), dict(logit_bias={5: 2.0}),
             dict(prompt_logprobs=1), {}]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=max_tokens,
                             ignore_eos=True, seed=i, logprobs=1 if i % 4 == 0 else None,
                             top_p=0.9 if i % 2 else 1.0, min_tokens=2 if i % 3 == 0 else 0,
                             stop_token_ids=list(range(3, 4 + i % 4)) if i % 3 == 0 else None,
                             **extra[i % len(extra)])
              for i in range(prompts)]
    # requests arrive as over HTTP: a burst, then one every step, so steps mix decode rows
    # with prompt chunks of every size (an offline batch would give full chunks only)
    engine, done, i = llm.engine, 0, 0
    while done < prompts:
        for _ in range(burst if i == 0 else 1):
            if i < prompts:
                engine.add_request(f"r{i}", work[i]["prompt_token_ids"], params[i])
                i += 1
        done += sum(o.finished for o in engine.step())
    return variants


def report(variants: Variants) -> int:
    start, new = variants.new("start"), variants.new("workload")
    kernels = sorted(set(start) | set(new))
    print("\n| kernel | variants at start-up | new in the workload | an int argument's class "
          "that differs |")
    print("|---|---:|---:|---|")
    total = 0
    for k in kernels:
        fresh = new.get(k, {})
        total += len(fresh)
        diff = _differs(list(start.get(k, {})), list(fresh)) if fresh else ""
        print(f"| {k} | {len(start.get(k, {}))} | {len(fresh)} | {diff} |")
    print(f"variants compiled while serving: {total}")
    return total


def _differs(start: list[tuple], fresh: list[tuple]) -> str:
    """The params whose class in a new variant matches no start-up variant's."""
    out = []
    for key in fresh:
        for i, (name, *spec) in enumerate(key[:-1]):
            shown = f"{name}={spec[1] if spec[0] == 'constexpr' else spec}"
            if all(s[i][1:] != tuple(spec) for s in start) and shown not in out:
                out.append(shown)
    return ", ".join(out[:6])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen3")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--max-prompt", type=int, default=90, help="prompt lengths 8 .. this")
    ap.add_argument("--experts", type=int, default=8, help="the real shape's: 128")
    ap.add_argument("--top-k", type=int, default=2, help="the real shape's: 8")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--burst", type=int, default=8, help="requests at once, then one a step")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="n-gram speculation of K drafts (verify steps in the workload)")
    args = ap.parse_args(argv)
    report(run(args.prompts, args.budget, args.max_tokens, experts=args.experts,
               top_k=args.top_k, max_num_seqs=args.max_num_seqs, max_prompt=args.max_prompt,
               burst=args.burst, arch=args.arch, speculative=args.speculative))
    return 0


if __name__ == "__main__":
    sys.exit(main())
