"""The transformers side of bench/throughput.py, and the workload pieces both engines share:
the prompts, the warm-up size, a run's ``Result``. ``run_transformers``: continuous batching
(``generate_batch``, paged attention); ``run_transformers_generate``: ``generate`` on one static
batch, for a gated-DeltaNet hybrid (its continuous batching takes no linear-attention layers).
"""

from __future__ import annotations

import dataclasses
import gc
import random
import time

import torch
from shapes import hf_config

WARM_REQUESTS, WARM_TOKENS = 16, 8


@dataclasses.dataclass
class Result:
    workload: str
    engine: str
    wall_s: float | None = None
    out_tokens: int = 0
    steps: int | None = None
    note: str = ""

    @property
    def tok_s(self) -> float | None:
        return self.out_tokens / self.wall_s if self.wall_s else None


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]



def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_transformers(cfg: dict, work: dict, args, dtype: torch.dtype) -> list[Result]:
    """transformers ``generate_batch`` per workload: a warm-up call that keeps its manager
    (``persistent_manager=True``, so sized by the explicit config, not the warm-up's hints),
    then the timed call on that manager; the manager is destroyed before the next workload."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    hf_cfg = hf_config(cfg)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(
            hf_cfg, dtype=dtype, attn_implementation=args.hf_attn).eval()
    # 5.17 calls the KV page size block_size; later versions page_size (block_size deprecated)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page = "page_size" if "page_size" in fields else "block_size"
    results = []
    try:
        for name, (n, in_len, out_len) in work.items():
            cb_kw = {page: args.hf_block_size, "max_requests_per_batch": args.max_num_seqs,
                     "max_batch_tokens": args.max_num_batched_tokens}
            if args.hf_num_blocks or args.tiny:  # tiny: only what the workload needs (CPU)
                need = n * (-(-(in_len + out_len) // args.hf_block_size))
                cb_kw["num_blocks"] = args.hf_num_blocks or need
            if "flash" in args.hf_attn:  # decode fast path: block table sized like the hints
                blocks = -(-(in_len + out_len) // args.hf_block_size) + 1
                cb_kw["max_blocks_per_request"] = blocks + blocks % 2
            cb = ContinuousBatchingConfig(**cb_kw)
            gen = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1,
                                   pad_token_id=0)
            warm = prompts(min(n, WARM_REQUESTS), in_len, cfg["vocab_size"], seed=1)
            model.generate_batch(warm, generation_config=gen, continuous_batching_config=cb,
                                 max_new_tokens=WARM_TOKENS, persistent_manager=True)
            mgr = getattr(model, "_cached_continuous_batching_manager", None)
            cache = getattr(getattr(mgr, "batch_processor", None), "cache", None)
            rcfg = getattr(mgr, "continuous_batching_config", None)
            print(f"[transformers {name}] attn={model.config._attn_implementation} "
                  f"num_blocks={getattr(cache, 'num_blocks', '?')} "
                  f"{page}={getattr(cache, 'block_size', args.hf_block_size)} "
                  f"max_batch_tokens={getattr(cache, 'max_batch_tokens', '?')} "
                  f"max_requests_per_batch={getattr(rcfg, 'max_requests_per_batch', '?')} "
                  f"cuda_graphs={getattr(rcfg, 'use_cuda_graph', '?')}", flush=True)
            mgr = cache = rcfg = None  # no reference to the model may outlive this function
            ps = prompts(n, in_len, cfg["vocab_size"], seed=0)
            sync(args.device)
            t0 = time.perf_counter()
            outs = model.generate_batch(ps, generation_config=gen, continuous_batching_config=cb,
                                        max_new_tokens=out_len, record_timestamps=True)
            wall = time.perf_counter() - t0
            model.destroy_cached_continuous_batching_manager()
            got = [len(o.generated_tokens) for o in outs.values() if o.error is None]
            stamps = [o.timestamps[-1] for o in outs.values() if o.timestamps]
            if stamps:  # submission -> last token (leaves out the manager's stop and gc)
                wall = max(stamps) - t0
            note = "" if len(got) == n and set(got) == {out_len} else (
                f"only {len(got)}/{n} requests ok, tokens {sorted(set(got))}")
            results.append(Result(name, "transformers", wall, sum(got), None, note))
    finally:
        if hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def run_transformers_generate(cfg: dict, work: dict, args, dtype: torch.dtype) -> list[Result]:
    """transformers ``generate`` on one static batch per workload, for a model whose layers
    its continuous batching refuses (``generate_batch``: "Invalid layer type:
    linear_attention", transformers 5.x): every prompt the same length (no padding), a
    warm-up generate of ``WARM_TOKENS`` first, then the timed one to exactly ``out_len``."""
    from transformers import AutoModelForCausalLM

    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(hf_config(cfg), dtype=dtype).eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    results = []
    try:
        for name, (n, in_len, out_len) in work.items():
            warm = prompts(min(n, WARM_REQUESTS), in_len, cfg["vocab_size"], seed=1)
            model.generate(torch.tensor(warm, device=args.device), max_new_tokens=WARM_TOKENS,
                           min_new_tokens=WARM_TOKENS, **kw)
            ids = torch.tensor(prompts(n, in_len, cfg["vocab_size"], seed=0), device=args.device)
            sync(args.device)
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, **kw)
            sync(args.device)
            wall = time.perf_counter() - t0
            results.append(Result(name, "transformers", wall, n * (out.shape[1] - in_len), None,
                                  "generate, one static batch (its continuous batching takes "
                                  "no linear-attention layers)"))
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results
