"""EngineArgs: every option that builds an engine, and ``build_engine`` that assembles one.

Invariants: the same arguments build the same engine in-process (``LLM``) or inside the
HeadActor (server, EP); options are plain values (they cross process boundaries as msgpack
maps, never pickles); an invalid option raises ``ValueError`` naming it before anything loads.
Every option's value is checked here and nowhere else (``LLM``, the CLI and the server hold no
copies); ``check_on_this_machine`` adds the checks that read the driver's machine (device,
model and tokenizer folders) for ``LLM``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from epserve.head.engine import Engine, EngineConfig
from epserve.head.limits import RequestLimits
from epserve.head.reasoning import REASONING_PARSERS, ThinkTags
from epserve.head.speculative import SpeculativeConfig
from epserve.head.scheduler import SchedulerConfig
from epserve.models.config import CheckpointError, ModelConfig
from epserve.models.sampling_rules import resolve_max_logprobs
from epserve.worker.ep_results import max_logprobs_in_frame

if TYPE_CHECKING:  # imported where used: the ingress and the CLI's checks load no torch
    from epserve.worker.runner import RunnerConfig
    from epserve.worker.step_model import StepModel


#: How the EP ranks' placement group may be laid out on the Ray cluster (Ray's strategies).
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class EngineArgs:
    """``model=None`` is the built-in demo model (random weights; its text is random)."""

    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    ep_size: int = 1
    placement_strategy: str = "STRICT_PACK"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    decode_lookahead: bool | None = None
    # EP ranks: a collective (the command broadcast included) not done within this many
    # seconds breaks the group; an idle leader sends an empty step every quarter of it
    ep_timeout_s: float = 120.0
    # per-request bounds (head/limits.py): a request over one is refused naming its field
    max_n: int = RequestLimits.max_n
    max_stop_strings: int = RequestLimits.max_stop_strings
    max_stop_chars: int = RequestLimits.max_stop_chars
    max_stop_token_ids: int = RequestLimits.max_stop_token_ids
    max_logit_bias: int = RequestLimits.max_logit_bias
    max_logprobs: int = RequestLimits.max_logprobs  # -1: the vocabulary size (vLLM's)
    # vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4, ...} (head/speculative.py)
    speculative_config: dict | None = None
    # vLLM's --reasoning-parser: the thinking tags the engine bans once a row closed its
    # thinking, and after which a structured output's grammar holds (head/reasoning.py)
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "ep_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        t = self.ep_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"ep_timeout_s must be a positive number of seconds, got {t!r}")
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.decode_lookahead is not None and not isinstance(self.decode_lookahead, bool):
            raise ValueError(f"decode_lookahead must be true, false or None (on with CUDA "
                             f"graphs), got {self.decode_lookahead!r}")
        if self.decode_lookahead and self.ep_size > 1:
            raise ValueError("decode_lookahead=True needs ep_size=1: expert-parallel ranks run "
                             "each forward in lockstep, so none can run one ahead")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"placement_strategy must be {', '.join(PLACEMENT_STRATEGIES[:-1])} "
                             f"or {PLACEMENT_STRATEGIES[-1]}, got {self.placement_strategy!r}")
        for name in ("max_model_len", "num_kv_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {v!r}")
        k = self.max_logprobs
        if isinstance(k, bool) or not isinstance(k, int) or k < -1:
            raise ValueError(f"max_logprobs must be an integer >= -1 (-1: the vocabulary "
                             f"size), got {k!r}")
        self.request_limits(vocab_size=0)  # its ValueError names the option
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {list(REASONING_PARSERS)} or "
                             f"None, got {self.reasoning_parser!r}")
        t = self.long_prefill_token_threshold
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an int >= 0 (0 = no cap), "
                             f"got {t!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        _check_device_name(self.device)
        SpeculativeConfig.from_dict(self.speculative_config)  # its ValueError names the key

    def check_on_this_machine(self) -> None:
        """The checks that read this machine, before anything loads: the device is present,
        ``model`` is a checkpoint folder we can serve (``CheckpointError``), ``tokenizer`` is a
        folder with a tokenizer. (``__post_init__`` checks only values: these args also cross
        to the HeadActor, which may run where the driver's files and devices are not.)"""
        _check_device_present(self.device)
        if self.model is not None:
            check_model_path(self.model)
        if self.tokenizer is not None and not any(
                (Path(self.tokenizer) / f).is_file() for f in TOKENIZER_FILES):
            raise ValueError(f"tokenizer={str(self.tokenizer)!r}: no tokenizer.json, "
                             f"tokenizer_config.json or tokenizer.model in that folder")

    def request_limits(self, vocab_size: int | None = None) -> RequestLimits:
        """The per-request limits, ``max_logprobs`` -1 resolved to ``vocab_size`` (which
        only that needs)."""
        if self.max_logprobs == -1 and vocab_size is None:
            raise ValueError("max_logprobs=-1 is the vocabulary size: pass vocab_size")
        return RequestLimits(max_n=self.max_n, max_stop_strings=self.max_stop_strings,
                             max_stop_chars=self.max_stop_chars,
                             max_stop_token_ids=self.max_stop_token_ids,
                             max_logit_bias=self.max_logit_bias,
                             max_logprobs=resolve_max_logprobs(self.max_logprobs,
                                                               vocab_size or 0))

    def resolved(self) -> "EngineArgs":
        """The same args with ``model`` a local folder: the demo model (built when ``model`` is
        None), or a hub id's snapshot (``models.hub``; the id becomes the served name)."""
        if self.model is not None:
            from epserve.models.hub import local_checkpoint

            path = local_checkpoint(self.model)
            if path == self.model:
                return self
            return dataclasses.replace(self, model=path, served_model_name=(
                self.served_model_name or self.model))
        from epserve.models.demo import demo_model_path

        return dataclasses.replace(self, model=str(demo_model_path()))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EngineArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def runner_config(self) -> RunnerConfig:
        from epserve.worker.runner import RunnerConfig

        assert self.model is not None, "call resolved() first"
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        return RunnerConfig(
            model=self.model, dtype=self.dtype, device=self.device,
            max_model_len=self.max_model_len, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.max_num_seqs,
            enable_prefix_caching=self.enable_prefix_caching, load_format=self.load_format,
            seed=self.seed, gpu_memory_utilization=float(self.gpu_memory_utilization),
            enforce_eager=bool(self.enforce_eager),
            warmup_tokens=self.max_num_batched_tokens, decode_lookahead=self.decode_lookahead,
            max_logprobs=self.max_logprobs,
            mtp_drafts=spec.num_speculative_tokens if spec and spec.method == "mtp" else 0,
            speculative_tokens=spec.num_speculative_tokens if spec else 0)


def _check_device_name(device: Any) -> None:
    """``ValueError`` naming ``device`` when torch cannot parse it or it is no cpu/cuda."""
    if not isinstance(device, str):
        raise ValueError(f"device must be a string such as 'auto', 'cpu' or 'cuda:0', "
                         f"got {device!r}")
    if device == "auto":
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a device torch knows; use 'auto', 'cpu' "
                         f"or 'cuda[:N]'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: only 'auto', 'cpu' and 'cuda[:N]' are supported")


def _check_device_present(device: str) -> None:
    """``ValueError`` naming a CUDA ``device`` this machine does not have."""
    if device == "auto":
        return
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={device!r}: CUDA is not available on this machine; "
                             f"use device='cpu' or 'auto'")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device={device!r}: this machine has {count} CUDA device(s)")


def check_model_path(path: str) -> None:
    """``CheckpointError`` naming ``path`` when it is not a checkpoint folder we can serve
    (checked before any process or actor starts, so the user sees one clear line)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"model {path}: no such folder (expected a Hugging Face checkpoint "
                              f"folder with config.json and safetensors weights)")
    if not p.is_dir():
        raise CheckpointError(f"model {path}: not a folder (expected a Hugging Face checkpoint "
                              f"folder with config.json and safetensors weights)")
    ModelConfig.from_pretrained(path)  # config.json present, architecture supported


def check_reasoning_parser(args: EngineArgs) -> None:
    """``ValueError`` naming ``reasoning_parser`` when the resolved ``args``' tokenizer lacks
    its thinking tags (checked before any actor starts: the engine refuses them as well)."""
    if args.reasoning_parser is not None:
        ThinkTags.of(args.reasoning_parser, load_tokenizer(args.model, args.tokenizer),
                     ModelConfig.from_pretrained(args.model).vocab_size)


class NoTokenizer:
    """Stands in where a checkpoint ships no tokenizer: token ids in, empty text out."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def load_tokenizer(path: str, tokenizer: str | None) -> Any:
    """The checkpoint's (or ``tokenizer``'s) HF tokenizer, or None when it ships none."""
    src = tokenizer or path
    if not any((Path(src) / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src)


def eos_token_ids(path: str, config_eos: Sequence[int], tok: Any) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, together."""
    ids = set(config_eos)
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tok is not None and isinstance(getattr(tok, "eos_token_id", None), int):
        ids.add(tok.eos_token_id)
    return frozenset(ids)


def build_engine(args: EngineArgs, runner: Any = None) -> tuple[Engine, Any, Any]:
    """(engine, runner, tokenizer-or-None) for resolved ``args``; ``runner`` overrides the
    default one-rank ``StepModel`` (the EP group passes its N-rank one)."""
    from epserve.worker.step_model import StepModel

    args = args.resolved()
    if runner is None:
        if args.ep_size != 1:
            raise ValueError(f"ep_size={args.ep_size} needs the EP cluster (cluster.bringup)")
        runner = StepModel.one_rank(args.runner_config())
    tok = load_tokenizer(args.model, args.tokenizer)
    mc = runner.model_config
    limits = args.request_limits(mc.vocab_size)
    check_logprobs_fit(args, limits.max_logprobs)
    tags = ThinkTags.of(args.reasoning_parser, tok, mc.vocab_size)
    spec = SpeculativeConfig.from_dict(args.speculative_config)
    draft = build_draft(args, spec, runner) if spec is not None and spec.model else None
    engine = Engine(runner, tok or NoTokenizer(), EngineConfig(
        max_model_len=runner.max_model_len, vocab_size=mc.vocab_size,
        eos_token_ids=eos_token_ids(args.model, mc.eos_token_ids, tok), seed=args.seed,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            enable_prefix_caching=runner.prefix_caching),  # off for recurrent state
        limits=limits, speculative=spec, think_tags=tags), draft)
    return engine, runner, tok


def check_logprobs_fit(args: EngineArgs, k: int) -> None:
    """``ValueError`` naming ``max_logprobs`` when, under EP, ``k`` alternatives for every
    token of a full step (``max_num_batched_tokens``) would not fit one rank's result frame
    (``MAX_FRAME_BYTES``); one rank hands its results over as objects, unbounded."""
    most = max_logprobs_in_frame(args.max_num_batched_tokens)
    if args.ep_size > 1 and k > most:
        raise ValueError(f"max_logprobs={args.max_logprobs} ({k} alternatives per token) "
                         f"exceeds {most}, the most an expert-parallel rank's result frame "
                         f"carries per token when a step holds max_num_batched_tokens="
                         f"{args.max_num_batched_tokens} tokens; lower max_logprobs or "
                         f"max_num_batched_tokens")


def build_draft(args: EngineArgs, spec: SpeculativeConfig, target: Any) -> StepModel:
    """The draft model of a ``draft_model`` config, on rank 0's device beside ``target``
    (``head.draft_proposer`` says why there): its own KV cache, in what
    ``gpu_memory_utilization`` + 0.05 of the GPU leaves after the target (CUDA). ``ValueError``
    naming the key when it cannot draft for ``target``."""
    from epserve.worker.runner import RunnerConfig
    from epserve.worker.step_model import StepModel

    assert spec.model is not None
    try:
        check_model_path(spec.model)
        draft = StepModel.one_rank(RunnerConfig(
            model=spec.model, dtype=args.dtype, device=str(target.runner.device),
            max_model_len=target.max_model_len, block_size=args.block_size,
            num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=False, load_format=args.load_format, seed=args.seed,
            gpu_memory_utilization=min(0.98, float(args.gpu_memory_utilization) + 0.05),
            enforce_eager=bool(args.enforce_eager), decode_lookahead=False))
    except (CheckpointError, ValueError) as exc:
        raise ValueError(f"speculative_config.model: {exc}") from None
    want, got = target.model_config.vocab_size, draft.model_config.vocab_size
    if got != want:
        raise ValueError(f"speculative_config.model: the draft's vocabulary has {got} tokens, "
                         f"the target's {want}: a draft model must share the target's tokenizer")
    return draft
