"""The ``epserve`` command: ``generate`` streams one prompt's text; ``serve`` runs the server.

Invariants: with no ``--model`` every command uses the built-in demo model (built locally on
first use, nothing downloaded); bad input exits with status 2 and one clear line on stderr,
never a traceback: a usage error or an invalid option value (``--port 99999``) as argparse finds
it, before anything loads, as much as a value the engine or the server refuses.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import epserve
from epserve.deploy.engine_flags import add_engine_flags, add_limit_flags, engine_options
from epserve.deploy.reasoning_parser import REASONING_PARSERS
from epserve.deploy.tool_parser import TOOL_PARSERS


class _Help(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one and does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line (the usage of ``serve`` alone is a screenful):
    status 2 and ``epserve: error: ...`` on stderr, pointing at ``--help``; help texts end
    with their defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"epserve: error: {message} (see '{self.prog} --help')\n")


def _port(value: str) -> int:
    """A TCP port to listen on, 1-65535."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {value!r}")
    return port


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="epserve", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--version", action="version", version=epserve.__version__,
                    help="print the version (as vLLM's --version, the bare number) and exit")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="stream the continuation of one prompt")
    g.add_argument("prompt", help="the text to continue")
    add_engine_flags(g)
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0: off)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the likeliest one's probability")
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on past the end-of-sequence token")
    g.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the chat template")
    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_engine_flags(s)
    add_limit_flags(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=_port, default=8000, help="HTTP port")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but /health and "
                        "/ping (default: $EPSERVE_API_KEY; unset: no auth)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model, or epserve-demo)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20,
                   help="largest request body accepted, in bytes; larger ones get 413")
    s.add_argument("--api-server-count", type=int, default=1,
                   help="ingress replicas (tokenization, templates, SSE) in front of the one "
                        "engine; as vLLM's option of the same name")
    s.add_argument("--body-read-timeout", type=float, default=None,
                   help="seconds a request body may take to arrive (then 408); default 30")
    s.add_argument("--header-read-timeout", type=float, default=None,
                   help="seconds a request line and headers may take to arrive (then 408); "
                        "default 30")
    s.add_argument("--ingress", choices=["auto", "haproxy", "proxy"], default="auto",
                   help="what takes HTTP on the port: HAProxy (faster streaming; its own HTML "
                        "400 for a request it cannot parse or a head over 64 KiB, and HTML 408 "
                        "for a head that stalls: README) or Serve's Python proxy; auto: "
                        "HAProxy where its binary runs and this command starts the cluster, "
                        "else the proxy")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse the model's tool calls when a chat request has tools and "
                        "tool_choice auto (needs --tool-call-parser); as vLLM's flag")
    s.add_argument("--tool-call-parser", default=None, choices=list(TOOL_PARSERS),
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>: "
                        "Qwen2.5, Qwen3, Hermes) (default: none)")
    s.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="separate <think>...</think> into the chat message's "
                        "reasoning_content: qwen3 or deepseek_r1; the engine then never "
                        "reopens a closed thinking block and holds structured output until "
                        "the thinking ends (default: none)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="every logprobs token string is 'token_id:N' (a request's own "
                        "return_tokens_as_token_ids overrides it); as vLLM's flag")
    return ap


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
