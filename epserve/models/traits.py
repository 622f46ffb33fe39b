"""The scheduler-facing model interface (the seed's ``traits`` module) and its types.

Owns every name of ``seed/traits.md`` in Python, with the same meaning: the per-sequence
state (``SequenceState``), the inputs and results of forward passes, the EP failure type, the
decode-batch ladder and the logprob helpers. Invariants: no torch, no device code; the
protocols are the only way the head reaches a model. A runner opts into a capability by
listing it in ``capabilities()``; a request that needs an absent capability is refused.

Python adaptation, on purpose: the seed's forwards return raw logits pointers that the
scheduler reads back through ``ModelLogits``. Here every row carries its ``RowSampling`` in
its ``SequenceState``, the runner samples on its own device, and a forward's result holds the
sampled tokens (``SampledToken``). That is what the EP leader can gather from other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol, Sequence, runtime_checkable

# --------------------------------------------------------------------------- constants

#: The rungs ``padded_batch_n`` pads to.
DECODE_BATCH_LADDER: tuple[int, ...] = (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)

#: ``RowMask`` entry meaning "no token".
ROW_MASK_NONE = 0xFFFFFFFF

#: The two token ids the host would re-pick around for a row on the argmax fast path
#: (``ROW_MASK_NONE`` = none): the closed-thinking mask.
RowMask = tuple[int, int]


def padded_batch_n(n: int) -> int:
    """The padded batch size for ``n`` live rows: the smallest ladder rung >= n, n above 128."""
    if n < 0:
        raise ValueError(f"padded_batch_n: n must be >= 0, got {n}")
    for rung in DECODE_BATCH_LADDER:
        if rung >= n:
            return rung
    return n


# The logprob helpers live in ``models.logprobs`` (the seed's ``traits::logprobs``).
from epserve.models.logprobs import (  # noqa: E402  (re-exported: seed names)
    PromptTokenLogprob, bf16_to_f32, extract_bf16, logprob_of,
)


# --------------------------------------------------------------------------- enums


class FeedSource(Enum):
    """Where a fed decode row's input token comes from: ``HOST``, a token the host knows
    (carried next to it); ``DEVICE``, the one this rank sampled for the row last step."""

    HOST = "host"
    DEVICE = "device"


class ForwardSelect(Enum):
    """The forward a model's decode runs: the hand-written layer loop, or a circuit plan."""

    LEGACY = "legacy"
    CIRCUIT = "circuit"


# --------------------------------------------------------------------------- sequence state


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How the runner picks a row's next token (set by the head).

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` and ``min_p == 0`` are
    off. ``seed`` keys a counter-based generator with the output index, so a row's draw depends
    on (seed, index) only: reproducible across batches, preemption and ranks.
    ``banned_token_ids``: ids never sampled now (EOS and stop ids while under ``min_tokens``).
    ``logprobs``: top-k alternatives to return with each sampled token; ``None`` returns none.
    ``logit_bias``: (token id, bias) pairs, ids rising, each bias in [-100, 100], added to the
    row's logits before it samples (greedy too); its logprobs stay those of the raw logits.
    Penalties (vLLM's, after the bias; 0, 0, 1: off): ``repetition_penalty`` divides positive and
    multiplies negative logits of prompt and output tokens; then ``frequency_penalty`` x count
    and ``presence_penalty`` are subtracted from each output token's.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    banned_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sampled token: id, its logprob under the raw distribution, top-k alternatives, and
    its ``rank`` there (vLLM's: the tokens at least as likely, itself included; None: not asked)."""

    token_id: int
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(slots=True)
class ChunkedPrefillPageMetadata:
    """Per-sequence copies of the paged-attention metadata kept across prefill chunks: block
    table entries sized for the whole prompt, and how many are already on the device."""

    block_capacity: int = 0
    uploaded_blocks: int = 0


@dataclass(slots=True)
class SequenceState:
    """One sequence's state across prefill and decode, allocated by the model. Each field has
    one writer: the head's (``head.sequence.Sequence.sync_state``) or the model's.

    - ``tokens``: prompt and generated ids the KV covers or will cover (the model appends).
    - ``block_table``: physical KV blocks in logical order (the model).
    - ``seq_len``: tokens whose KV is written (the model).
    - ``slot_idx``: the model's handle for this sequence (``alloc_sequence``).
    - ``rank``: the EP rank whose KV pool holds the sequence (its placement, ``alloc_sequence``);
      read by the model's KV book and step routing only, never by the scheduler.
    - ``cached_prefix_tokens`` / ``cached_prefix_blocks``: prefix-cache match (``match_prefix``).
    - ``reused_prefix_tokens``: prompt tokens whose KV was read from the cache, not recomputed.
    - ``prompt_len``: prompt tokens (head).
    - ``collect_prompt_logprobs``: ``k`` to score every prompt position with top-k (head);
      such a sequence bypasses the prefix cache. ``prompt_logprobs``: filled per chunk (the model).
    - ``sampling``: the row's ``RowSampling`` (head); ``output_index`` the count of tokens
      sampled so far for it, the generator's counter (head).
    - ``adapter_slot`` / ``adapter_id``: LoRA selection (no adapters yet: -1 / 0).
    - ``lookahead``: the row's next decode step is likely (its next token is not known to be
      its last); the model may queue that step's forward early (head).
    - ``token_mask``: a constrained row's allowed next tokens, ``ceil(vocab / 32)`` packed
      int32 words (numpy, refilled in place after each token), None when unconstrained (head).
    - ``drafts``: the tokens the model's MTP head proposes after the last sampled one (the
      model, after each step that samples the sequence; ``ModelDraft``).
    """

    tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    seq_len: int = 0
    slot_idx: int = -1
    rank: int = 0
    cached_prefix_tokens: int = 0
    cached_prefix_blocks: int = 0
    reused_prefix_tokens: int = 0
    prefix_lookup_applied: bool = False
    kv_valid_tokens: int = 0
    prompt_len: int = 0
    chunked_prefill_meta: ChunkedPrefillPageMetadata | None = None
    collect_prompt_logprobs: int | None = None
    prompt_logprobs: list[PromptTokenLogprob] = field(default_factory=list)
    sampling: RowSampling = field(default_factory=RowSampling)
    output_index: int = 0
    adapter_slot: int = -1
    adapter_id: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    lookahead: bool = True
    token_mask: Any = None
    drafts: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefillSlice:
    """One prefilling stream's chunk: ``prompt_tokens[chunk_start : chunk_start + chunk_len]``
    of the full prompt (after a preemption: prompt plus tokens generated so far); only
    ``is_last_chunk`` produces a sampled token."""

    prompt_tokens: Sequence[int]
    seq: SequenceState
    chunk_start: int
    chunk_len: int
    is_last_chunk: bool


@dataclass(frozen=True, slots=True)
class MixedForwardResult:
    """Decode rows plus one prefill chunk: sampled tokens per decode row, and the prefill's
    token when its chunk was the last (else ``None``). ``*_logits`` are runner-side handles
    (``[rows, vocab]`` float32 on the runner's device) or ``None`` where not kept."""

    decode: tuple[SampledToken, ...]
    prefill: SampledToken | None
    decode_logits: Any = None
    prefill_logits: Any = None


@dataclass(frozen=True, slots=True)
class MixedBatchResult:
    """M decode rows plus N prefill chunks: one ``SampledToken`` per decode row, and one entry
    per prefill stream in input order (``None`` unless that chunk was its last).

    ``failed``: rows that did not run, by index (decode rows ``0..M-1``, prefill streams
    ``M..M+N-1``) -> why; their entries above are placeholders. The other rows ran.
    ``verified``: decode row -> the target's token at each position of a row that had drafts
    (its ``decode`` entry is the first); emit up to ``models.acceptance.accepted`` + 1."""

    decode: tuple[SampledToken, ...]
    prefill: tuple[SampledToken | None, ...]
    decode_logits: Any = None
    prefill_logits: Any = None
    failed: dict[int, str] = field(default_factory=dict)
    verified: dict[int, tuple[SampledToken, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BeamReq:
    """One beam-search request (translation models): the per-request parameters."""

    tokens: tuple[int, ...]
    max_new_tokens: int
    num_beams: int = 4
    length_penalty: float = 1.0
    early_stopping: bool = False
    src_lang_id: int = 0
    tgt_lang_id: int = 0


@dataclass(frozen=True, slots=True)
class VerifyBatchedOpts:
    """Per-call options for ``ModelVerify.decode_verify_batched``."""

    write_on_accept: bool = False


@dataclass(frozen=True, slots=True)
class PrefixReclaim:
    """What ``reclaim_prefix_blocks_for`` left: blocks a prefill needs (``target``) and the free
    count reached (``free``). ``free < target`` means nothing more was evictable."""

    target: int
    free: int


@dataclass(frozen=True, slots=True)
class ForwardDisclosure:
    """What a record states about the forward: which one, and when known its plan digest and
    kernel launches per step."""

    forward: ForwardSelect = ForwardSelect.LEGACY
    plan_digest: str | None = None
    launches_per_step: int | None = None


# The failure types live in ``models.errors`` (re-exported: seed names).
from epserve.models.errors import (  # noqa: E402
    CapabilityAbsent, EpCommandFailed, RankFailure,
)


# --------------------------------------------------------------------------- the traits
# Every capability below has a name in ``ALL_CAPABILITIES``; a runner lists what it has.

ALL_CAPABILITIES = (
    "forward", "lifecycle", "logits", "verify", "draft", "adapters", "ssm_state", "ep",
    "streams", "device_feed", "circuit", "vision", "beam",
)


@runtime_checkable
class ModelForward(Protocol):
    """Prefill, decode and mixed forward passes, and the model-shape queries."""

    def prefill(self, tokens: Sequence[int], seq: SequenceState) -> SampledToken: ...
    def prefill_chunk(self, tokens: Sequence[int], seq: SequenceState, chunk_start: int,
                      chunk_len: int, is_last_chunk: bool) -> SampledToken | None: ...
    def decode(self, token: int, seq: SequenceState) -> SampledToken: ...
    def decode_batch(self, tokens: Sequence[int], seqs: Sequence[SequenceState]) -> tuple[SampledToken, ...]: ...
    def mixed_forward(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                      prefill_tokens: Sequence[int], prefill_seq: SequenceState,
                      prefill_chunk_start: int, prefill_chunk_len: int,
                      prefill_is_last: bool) -> MixedForwardResult: ...
    def prefill_batch_chunk(self, slices: Sequence[PrefillSlice]) -> tuple[SampledToken | None, ...]: ...
    def mixed_forward_batch(self, decode_tokens: Sequence[int], decode_seqs: Sequence[SequenceState],
                            prefill_slices: Sequence[PrefillSlice],
                            drafts: Sequence[Sequence[int]] | None = None) -> MixedBatchResult: ...
    def supports_beam(self) -> bool: ...
    def generate_beam_batch(self, reqs: Sequence[BeamReq]) -> list[list[int]]: ...
    def is_mla(self) -> bool: ...
    def hc_mult(self) -> int: ...
    def kv_block_size(self) -> int | None: ...


@runtime_checkable
class ModelLifecycle(Protocol):
    """Teardown, sequence allocation and release, the prefix cache, and KV pool counts. A
    ``seq`` argument of a count or reclaim names the pool it draws from (None: every pool);
    a ``prompt`` given to ``alloc_sequence_for`` lets the model place it by its cache."""

    def teardown(self) -> None: ...
    def bind_gpu_to_thread(self) -> None: ...
    def alloc_sequence(self) -> SequenceState: ...
    def alloc_sequence_for(self, budget_tokens: int,
                           prompt: Sequence[int] | None = None) -> SequenceState: ...
    def match_prefix(self, seq: SequenceState, prompt: Sequence[int]) -> int: ...
    def reserve_blocks(self, seq: SequenceState, num_tokens: int) -> bool: ...
    def cache_sequence(self, seq: SequenceState) -> None: ...
    def free_sequence(self, seq: SequenceState) -> None: ...
    def rewind_sequence(self, seq: SequenceState, num_tokens: int) -> None: ...
    def shares_kv_pool(self, a: SequenceState, b: SequenceState) -> bool: ...
    def num_free_blocks(self, seq: SequenceState | None = None) -> int: ...
    def num_total_blocks(self, seq: SequenceState | None = None) -> int: ...
    def kv_cache_usage(self) -> float: ...
    def reclaim_prefix_blocks(self, num_blocks: int, seq: SequenceState | None = None) -> int: ...
    def reclaim_prefix_blocks_for(self, prompt: Sequence[int], adapter_slot: int,
                                  blocks_needed: int) -> PrefixReclaim: ...


@runtime_checkable
class ModelLogits(Protocol):
    """Reading a forward's output: vocab size and argmax over a logits handle."""

    def vocab_size(self) -> int: ...
    def argmax_batch(self, logits: Any) -> list[int]: ...
    def argmax_batch_masked(self, logits: Any, masks: Sequence[RowMask]) -> list[int]: ...


@runtime_checkable
class ModelEp(Protocol):
    """The multi-rank (EP) command protocol (rank > 0 loops on ``ep_worker_step``)."""

    def is_ep(self) -> bool: ...
    def ep_worker_step(self) -> bool: ...
    def ep_keep_alive(self) -> None: ...  # idle leader: a no-op round before ranks time out


@runtime_checkable
class ModelStreams(Protocol):
    """Streams, events and host synchronisation."""

    def synchronize(self) -> None: ...


@runtime_checkable
class ModelVerify(Protocol):
    """Speculative verify: ``tokens`` laid out sequence by sequence (each sequence's last token,
    then its ``ks[i]`` drafts); the target's token at every position, per sequence. The model
    keeps the accepted prefix (``models.acceptance``) and rewinds the rest itself."""

    def decode_verify_batched(self, tokens: Sequence[int], ks: Sequence[int], seqs: Sequence[SequenceState],
                              opts: VerifyBatchedOpts = VerifyBatchedOpts()) -> tuple[tuple[SampledToken, ...], ...]: ...


class ModelDraft(Protocol):
    """MTP drafts: with the capability, every step that samples a sequence leaves the MTP
    head's greedy proposals in ``SequenceState.drafts`` (``worker.mtp_drafter``)."""


class ModelAdapters(Protocol):
    """LoRA adapters (not implemented yet: declared absent)."""


class ModelSsmState(Protocol):
    """Recurrent state around a verify: the seed checkpoints, verifies, rolls back and commits
    (or, ``write_on_accept``, folds the accepted prefix in). Here every verify does the latter
    on the sequence's rank inside the step: states held (the checkpoint is the untouched
    state), the fold's inputs logged, and once the rank has sampled (``models.acceptance``)
    the fed token and accepted drafts folded in. The next rewind must lie inside the verified
    window; no snapshots are kept (no prefix caching; no use as a draft model)."""


class ModelDeviceFeed(Protocol):
    """The asynchronous device token feed (not implemented yet: declared absent)."""


class ModelCircuit(Protocol):
    """Forward selection (only ``ForwardSelect.LEGACY`` exists)."""

    def forward_disclosure(self) -> ForwardDisclosure: ...


class ModelVision(Protocol):
    """Vision-encoder input (not implemented yet: declared absent)."""


@runtime_checkable
class Model(ModelForward, ModelLifecycle, ModelLogits, ModelEp, ModelStreams, Protocol):
    """The whole scheduler-facing interface. ``capabilities()`` says which optional supertraits
    (verify, draft, adapters, ssm_state, device_feed, vision, beam, ...) are really there."""

    def capabilities(self) -> frozenset[str]: ...


def require_capability(model: Model, name: str, what: str) -> None:
    """Raise ``CapabilityAbsent`` naming ``what`` needs ``name`` when the model lacks it."""
    if name not in ALL_CAPABILITIES:
        raise ValueError(f"unknown capability {name!r}")
    if name not in model.capabilities():
        raise CapabilityAbsent(f"{what} needs the {name!r} capability, which this model runner "
                               f"does not have (it has: {', '.join(sorted(model.capabilities()))})")
