"""The engine's options as command-line flags, and the flags back as ``EngineArgs`` keywords.

One mapping for ``epserve generate`` and ``epserve serve`` (and ``deploy.server``'s config);
the values are checked by ``EngineArgs``, never here.
"""

from __future__ import annotations

import argparse
import json


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine options as flags (``generate`` and ``serve`` alike)."""
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint folder or hub id (org/name: fetched with "
                        "huggingface_hub, or read from its cache; HF_HUB_OFFLINE honoured) "
                        "(default: the built-in demo model, random weights)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the model folder's own tokenizer)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: the checkpoint's dtype; float32 on CPU "
                        "for a 16-bit checkpoint)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda:N")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt plus output, in tokens (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences in one step (running at once)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens one step computes (decode rows plus prefill chunks); "
                        "8192 keeps a large batch's prefill fast on a GPU")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks per rank (default: from --gpu-memory-utilization on "
                        "CUDA, 1 GiB on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + KV cache (CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly (no CUDA graphs)")
    p.add_argument("--no-decode-lookahead", action="store_true",
                   help="do not queue a decode step's likely successor on the GPU before its "
                        "tokens are read back (default: on with CUDA graphs)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV of a prompt prefix an earlier request computed "
                        "(default: reuse it)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights of the checkpoint's shape (benchmarks)")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks")
    # checked by EngineArgs (one clear line, exit 2), as every engine option's value is
    p.add_argument("--placement-strategy", default="STRICT_PACK",
                   help="how the EP ranks' placement group is laid out on the Ray cluster: "
                        "STRICT_PACK, PACK, SPREAD or STRICT_SPREAD")
    p.add_argument("--ep-timeout-s", type=float, default=120.0,
                   help="seconds an EP collective may take before the group counts as broken "
                        "(an idle server keeps its ranks' channel open at a quarter of it)")
    p.add_argument("--seed", type=int, default=0,
                   help="the engine's seed (a request without its own seed samples from it)")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding as JSON, vLLM\'s shape, e.g. \'{"method": '
                        '"ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
                        '(default: none)')


def _json_object(text: str) -> dict:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return v


def add_limit_flags(p: argparse.ArgumentParser) -> None:
    """Per-request bounds (epserve.head.limits): a request over one gets a 400 naming it."""
    from epserve.head.limits import RequestLimits

    d = RequestLimits()
    g = p.add_argument_group("per-request limits")
    g.add_argument("--max-n", type=int, default=d.max_n, help="most choices (n) per request")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                   help="most stop strings per request")
    g.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars,
                   help="most characters of all a request's stop strings together")
    g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                   help="most stop_token_ids per request")
    g.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias,
                   help="most logit_bias entries per request")
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most logprobs / prompt_logprobs alternatives per token; -1: the "
                        "vocabulary size (as vLLM's flag)")


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the ``add_engine_flags`` flags give, as ``LLM``/``EngineArgs``
    keywords (the values are checked by ``EngineArgs``)."""
    return dict(
        model=args.model, tokenizer=getattr(args, "tokenizer", None), dtype=args.dtype,
        device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
        load_format=args.load_format, ep_size=args.ep_size,
        placement_strategy=args.placement_strategy, ep_timeout_s=args.ep_timeout_s,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=getattr(args, "enforce_eager", False),
        decode_lookahead=False if getattr(args, "no_decode_lookahead", False) else None,
        speculative_config=getattr(args, "speculative_config", None),
        reasoning_parser=getattr(args, "reasoning_parser", None))
