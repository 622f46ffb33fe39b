"""The offline entry point, in the shape vLLM users know: ``LLM(...).generate / .chat``.

Turns prompts into token ids and checks them; the engine behind it is an ``LlmBackend``
(``llm_backend.py``): in this process (``LocalBackend``, ep_size=1) or in a HeadActor on Ray
(``RemoteEngine``, ep_size > 1), both assembled from ``EngineArgs``, the same path the server
takes. Invariants: every option is checked before anything loads (``ValueError`` naming it; a
checkpoint that cannot be served raises ``CheckpointError``); every request of a ``generate``
call is validated before any of them is queued, so a bad one raises ``ValueError`` (naming the
prompt and field) and leaves no trace (the engine's seed stream included); outputs come back
in the order of the prompts; a request that needs a capability the model lacks raises
``CapabilityAbsent``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator, Sequence

from epserve.cluster.engine_args import EngineArgs
from epserve.cluster.llm_backend import LlmBackend, LocalBackend
from epserve.cluster.remote_engine import RemoteEngine
from epserve.head.outputs import RequestOutput
from epserve.head.sampling_params import SamplingParams
from epserve.models.traits import BeamReq, require_capability

log = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


class LLM:
    """Generate text from a MoE checkpoint on this machine (CUDA when present, else CPU).

    ``model``: a Hugging Face folder (config.json + safetensors); ``None`` builds and uses the
    built-in demo model (random weights: its text is random). ``ep_size`` > 1 runs the
    experts over that many ranks on Ray (``RAY_ADDRESS``'s cluster, or a local one): the
    engine then lives in a HeadActor and ``close()`` releases it; ``ep_timeout_s``: how long an
    EP collective may take before the group counts as broken and re-forms (an idle engine
    sends its ranks an empty step every quarter of it). ``decode_lookahead``: queue
    each decode step's likely successor on the GPU before the host has read its tokens (None:
    on wherever decode CUDA graphs are; True also on CPU, where it only exercises the logic).
    ``max_n``, ``max_stop_strings``, ``max_stop_chars``, ``max_stop_token_ids``,
    ``max_logit_bias``, ``max_logprobs``: per-request limits (``head.limits.RequestLimits``;
    ``max_logprobs`` -1 is the vocabulary size, as vLLM's); a request over one is refused with
    a ``ValueError`` naming the field. ``speculative_config``: speculative decoding in vLLM's
    shape, e.g. ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 2}`` (``head.speculative``). ``reasoning_parser`` (``qwen3``,
    ``deepseek_r1``; vLLM's): a row that generated ``</think>`` never samples either thinking
    tag again, and a structured output holds once the reasoning ended (``head.reasoning``).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", max_model_len: int | None = None, seed: int = 0,
                 device: str = "auto", block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True,
                 load_format: str = "auto", ep_size: int = 1,
                 placement_strategy: str = "STRICT_PACK", ep_timeout_s: float = 120.0,
                 gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, decode_lookahead: bool | None = None,
                 max_n: int = 128, max_stop_strings: int = 256, max_stop_chars: int = 8192,
                 max_stop_token_ids: int = 4096, max_logit_bias: int = 1024,
                 max_logprobs: int = 20, speculative_config: dict | None = None,
                 reasoning_parser: str | None = None):
        args = EngineArgs(
            model=None if model is None else str(model), tokenizer=tokenizer, dtype=dtype,
            device=device, max_model_len=max_model_len, block_size=block_size,
            num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            long_prefill_token_threshold=long_prefill_token_threshold,
            enable_prefix_caching=enable_prefix_caching, load_format=load_format, seed=seed,
            ep_size=ep_size, placement_strategy=placement_strategy, ep_timeout_s=ep_timeout_s,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            decode_lookahead=decode_lookahead, max_n=max_n, max_stop_strings=max_stop_strings,
            max_stop_chars=max_stop_chars, max_stop_token_ids=max_stop_token_ids,
            max_logit_bias=max_logit_bias, max_logprobs=max_logprobs,
            speculative_config=speculative_config, reasoning_parser=reasoning_parser)
        args = args.resolved()  # the demo model built, a hub id fetched (or found cached)
        args.check_on_this_machine()  # device present, model and tokenizer folders
        self.args = args
        self.model_path = str(args.model)
        # the one place that asks where the engine runs; every call below goes to the backend
        self.backend: LlmBackend = RemoteEngine(args) if args.ep_size > 1 else LocalBackend(args)
        self.tokenizer = self.backend.tokenizer

    @property
    def engine(self) -> Any:
        """The in-process ``Engine`` (ep_size=1), for driving it step by step; None over EP."""
        return self.backend.engine

    @property
    def model(self) -> Any:
        """The in-process ``Model`` (a one-rank ``StepModel``; its device side is
        ``model.runner``); None over EP."""
        return self.backend.model

    # ------------------------------------------------------------------ the engine's state

    def stats(self) -> dict[str, Any]:
        """Counters and gauges (running, waiting, KV usage, tokens, preemptions, finished)."""
        return self.backend.stats()

    def health(self) -> dict[str, Any]:
        """``{"healthy": bool, "reason": str | None}``; over EP, false while a rank is dead."""
        return self.backend.health()

    def close(self) -> None:
        """Release the EP ranks (ep_size > 1); a no-op otherwise. Safe to call twice."""
        self.backend.close()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------------ prompts

    def _encode(self, text: str, i: int, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"prompts[{i}]: this model folder ({self.model_path}) has no "
                             f"tokenizer, so text cannot be encoded; pass "
                             f"{{'prompt_token_ids': [...]}} instead of text, or "
                             f"LLM(tokenizer=PATH)")
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _prompt_ids(self, prompt: PromptType, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, i)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompts[{i}].prompt_token_ids must be a list of ints, "
                                 f"got {type(ids).__name__}")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self._encode(prompt["prompt"], i)
        raise ValueError(f"prompts[{i}]: expected a string, {{'prompt': str}} or "
                         f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _params_list(self, n: int, params: SamplingParams | Sequence[SamplingParams] | None
                     ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        if not isinstance(params, (list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                             f"got {type(params).__name__}")
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, "
                                 f"got {type(sp).__name__}")
        return params

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: Any = None) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order; raises ``ValueError`` before running
        anything when a prompt or parameter is invalid. ``lora_request`` needs the model's
        'adapters' capability (``CapabilityAbsent`` otherwise)."""
        if lora_request is not None:
            require_capability(self.backend, "adapters", "generate(lora_request=...)")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(len(prompts), sampling_params)
        # Validate every prompt before queueing any: a refused call must leave no trace
        # (queued requests, ids, the engine's draw of per-request seeds).
        encoded = []
        for i, (p, sp) in enumerate(zip(prompts, params)):
            text, ids = self._prompt_ids(p, i)
            self._check_request(ids, sp, i)
            encoded.append((text, ids))
        return self.backend.generate(encoded, params, use_tqdm)

    def _check_request(self, ids: list[int], params: SamplingParams, i: int) -> None:
        try:
            self.backend.check_request(ids, params)
        except ValueError as exc:
            raise ValueError(f"prompts[{i}]: {exc}") from None

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it; the last
        one is finished. Closing the iterator early aborts the request."""
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, "
                             f"got {type(sampling_params).__name__}")
        params = sampling_params or SamplingParams()
        text, ids = self._prompt_ids(prompt, 0)
        self._check_request(ids, params, 0)
        return self.backend.stream(text, ids, params)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template: str | None = None, lora_request: Any = None) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template and generate."""
        if lora_request is not None:
            require_capability(self.backend, "adapters", "chat(lora_request=...)")
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.chat_prompt(conv, add_generation_prompt, chat_template) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def chat_prompt(self, conversation: list[dict[str, Any]], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> dict[str, Any]:
        """The ``{'prompt', 'prompt_token_ids'}`` prompt of one conversation: the chat template
        rendered, then encoded without adding special tokens again (the template has them)."""
        if self.tokenizer is None or not (chat_template or
                                          getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("chat: this model has no chat template; use generate() or pass "
                             "chat_template=")
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template)
        return {"prompt": text,
                "prompt_token_ids": list(self.tokenizer.encode(text, add_special_tokens=False))}

    # ------------------------------------------------------------------ capabilities

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: Any) -> list[list[int]]:
        """Beam search (vLLM's ``LLM.beam_search``): needs the model's 'beam' capability;
        ``CapabilityAbsent`` (a ``NotImplementedError``) when it lacks it, as every model of
        this version does. ``params``: ``beam_width``, ``max_tokens``, ``length_penalty``."""
        require_capability(self.backend, "beam", "beam_search")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        reqs = []
        for i, p in enumerate(prompts):
            _, ids = self._prompt_ids(p, i)
            reqs.append(BeamReq(tokens=tuple(ids), max_new_tokens=int(params.max_tokens),
                                num_beams=int(getattr(params, "beam_width", 4)),
                                length_penalty=float(getattr(params, "length_penalty", 1.0))))
        return self.backend.beam_search(reqs)
