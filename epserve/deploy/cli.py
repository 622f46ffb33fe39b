"""The ``epserve`` command: ``generate`` streams one prompt's text; ``serve`` runs the server.

Invariants: with no ``--model`` every command uses the built-in demo model (built locally on
first use, nothing downloaded); bad input exits with status 2 and one clear line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face checkpoint folder (default: the built-in demo model, "
                        "random weights)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the model folder's own tokenizer)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + KV cache (CUDA)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run decode steps eagerly (no CUDA graphs)")
    p.add_argument("--no-decode-lookahead", action="store_true",
                   help="do not queue a decode step's likely successor on the GPU before its "
                        "tokens are read back (default: on with CUDA graphs)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel ranks")
    # checked by EngineArgs (one clear line, exit 2), as every engine option's value is
    p.add_argument("--placement-strategy", default="STRICT_PACK",
                   help="how the EP ranks' placement group is laid out on the Ray cluster: "
                        "STRICT_PACK, PACK, SPREAD or STRICT_SPREAD")
    p.add_argument("--ep-timeout-s", type=float, default=120.0,
                   help="seconds an EP collective may take before the group counts as broken "
                        "(an idle server keeps its ranks' channel open at a quarter of it)")
    p.add_argument("--seed", type=int, default=0)


def _limit_args(p: argparse.ArgumentParser) -> None:
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
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                   help="most logprobs / prompt_logprobs alternatives per token (<= 20)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="epserve", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream the continuation of one prompt")
    g.add_argument("prompt")
    _engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the chat template")
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _engine_args(s)
    _limit_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: "
                        "$EPSERVE_API_KEY; unset: no auth)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model, or epserve-demo)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted; larger ones get 413")
    s.add_argument("--api-server-count", type=int, default=1,
                   help="ingress replicas (tokenization, templates, SSE) in front of the one "
                        "engine; as vLLM's option of the same name")
    s.add_argument("--body-read-timeout", type=float, default=None,
                   help="seconds a request body may take to arrive (then 408); default 30")
    return ap


def engine_options(args: argparse.Namespace) -> dict:
    """The engine options the ``_engine_args`` flags give, as ``LLM``/``EngineArgs`` keywords
    (one mapping for ``generate`` and ``serve``; the values are checked by ``EngineArgs``)."""
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
        decode_lookahead=False if getattr(args, "no_decode_lookahead", False) else None)


def _llm(args: argparse.Namespace):
    from epserve import LLM

    return LLM(**engine_options(args))


def _generate(args: argparse.Namespace) -> int:
    from epserve import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.sample_seed, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = _llm(args)
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError(f"{llm.model_path} has no tokenizer, so a text prompt cannot be "
                         f"encoded; pass --tokenizer PATH (a folder with tokenizer.json)")
    prompt = args.prompt
    if args.chat:
        if not getattr(tok, "chat_template", None):
            raise ValueError("--chat: this model has no chat template")
        # The same prompt as LLM.chat: the template's text, its special tokens not added twice.
        prompt = llm.chat_prompt([{"role": "user", "content": prompt}])
    shown = 0
    out = None
    for out in llm.stream(prompt, params):
        text = out.outputs[0].text
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)
    sys.stdout.write("\n")
    if out is not None and out.error:
        raise ValueError(out.error)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from epserve.deploy.server import serve_main

    return serve_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        return _serve(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as exc:
        print(f"epserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
