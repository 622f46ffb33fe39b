"""The offline entry point, in the shape vLLM users know: ``LLM(...).generate / .chat``.

Owns the assembly of one engine over its runner(s) and the tokenizer. Invariants: every
request of a ``generate`` call is validated before any of them runs, so a bad one raises
``ValueError`` (naming the prompt and field) and nothing is half-done; outputs come back in
the order of the prompts.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from epserve.head.engine import Engine, EngineConfig
from epserve.head.outputs import RequestOutput
from epserve.head.sampling_params import SamplingParams
from epserve.head.scheduler import SchedulerConfig
from epserve.worker.runner import Runner, RunnerConfig

log = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


class _NoTokenizer:
    """Stands in where a checkpoint ships no tokenizer: token ids in, empty text out."""

    eos_token_id = None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""


def _load_tokenizer(path: str, tokenizer: str | None) -> Any:
    src = tokenizer or path
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any((Path(src) / f).exists() for f in files):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(src)


def _eos_ids(path: str, config_eos: Sequence[int], tok: Any) -> frozenset[int]:
    ids = set(config_eos)
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    if tok is not None and isinstance(getattr(tok, "eos_token_id", None), int):
        ids.add(tok.eos_token_id)
    return frozenset(ids)


class LLM:
    """Generate text from a MoE checkpoint on this machine (CUDA when present, else CPU).

    ``model``: a Hugging Face folder (config.json + safetensors); ``None`` builds and uses the
    built-in demo model (random weights: its text is random). ``ep_size`` > 1 runs experts
    over several ranks on Ray.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, tokenizer: str | None = None,
                 dtype: str = "auto", max_model_len: int | None = None, seed: int = 0,
                 device: str = "auto", block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                 long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True,
                 load_format: str = "auto", ep_size: int = 1):
        if model is None:
            from epserve.models.demo import demo_model_path

            model = demo_model_path()
        self.model_path = str(model)
        if ep_size != 1:
            raise ValueError(f"ep_size={ep_size}: expert parallelism over several ranks is not "
                             f"available in this version; use ep_size=1")
        self.runner = Runner(RunnerConfig(
            model=self.model_path, dtype=dtype, device=device, max_model_len=max_model_len,
            block_size=block_size, num_kv_blocks=num_kv_blocks, max_num_seqs=max_num_seqs,
            enable_prefix_caching=enable_prefix_caching, load_format=load_format, seed=seed))
        self.tokenizer = _load_tokenizer(self.model_path, tokenizer)
        mc = self.runner.model_config
        self.engine = Engine(self.runner, self.tokenizer or _NoTokenizer(), EngineConfig(
            max_model_len=self.runner.max_model_len, vocab_size=mc.vocab_size,
            eos_token_ids=_eos_ids(self.model_path, mc.eos_token_ids, self.tokenizer), seed=seed,
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                long_prefill_token_threshold=long_prefill_token_threshold,
                enable_prefix_caching=enable_prefix_caching)))

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------------ prompts

    def _prompt_ids(self, prompt: PromptType, i: int) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompts[{i}]: this model folder has no tokenizer; pass "
                                 f"{{'prompt_token_ids': [...]}} instead of text")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=True))
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"prompts[{i}].prompt_token_ids must be a list of ints")
            return prompt.get("prompt"), list(ids)
        raise ValueError(f"prompts[{i}]: expected a string or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}")

    def _params_list(self, n: int, params: SamplingParams | Sequence[SamplingParams] | None
                     ) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"sampling_params: {len(params)} given for {n} prompts")
        return params

    # ------------------------------------------------------------------ generate

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order; raises ``ValueError`` before running
        anything when a prompt or parameter is invalid."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(len(prompts), sampling_params)
        added = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                text, ids = self._prompt_ids(p, i)
                try:
                    added.append(self.engine.add_request(None, ids, sp, prompt=text).request_id)
                except ValueError as exc:
                    raise ValueError(f"prompts[{i}]: {exc}") from None
        except ValueError:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return self._run(added, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts")
        wanted = set(request_ids)
        while len(final) < len(request_ids) and self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[r] for r in request_ids]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None
               ) -> Iterator[RequestOutput]:
        """Yield the request's cumulative output after every step that changed it."""
        text, ids = self._prompt_ids(prompt, 0)
        rid = self.engine.add_request(None, ids, sampling_params or SamplingParams(),
                                      prompt=text).request_id
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template and generate."""
        if self.tokenizer is None or not (chat_template or
                                          getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("chat: this model has no chat template; use generate() or pass "
                             "chat_template=")
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = []
        for conv in convs:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template)
            prompts.append({"prompt": text, "prompt_token_ids": list(
                self.tokenizer.encode(text, add_special_tokens=False))})
        return self.generate(prompts, sampling_params, use_tqdm)
