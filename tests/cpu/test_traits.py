"""The seed's functions and constants keep their exact semantics in Python."""

from __future__ import annotations

import math
import struct

import pytest

from epserve.models import traits as T


def test_ladder_and_padded_batch_n():
    assert T.DECODE_BATCH_LADDER == (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    assert T.padded_batch_n(0) == 2
    assert T.padded_batch_n(1) == 2
    assert T.padded_batch_n(2) == 2
    assert T.padded_batch_n(3) == 4
    assert T.padded_batch_n(9) == 12
    assert T.padded_batch_n(13) == 16
    assert T.padded_batch_n(97) == 128
    assert T.padded_batch_n(128) == 128
    assert T.padded_batch_n(129) == 129
    assert T.padded_batch_n(1000) == 1000
    for n in range(1, 129):
        p = T.padded_batch_n(n)
        assert p >= n and p in T.DECODE_BATCH_LADDER
        assert all(r < n for r in T.DECODE_BATCH_LADDER if r < p)
    with pytest.raises(ValueError):
        T.padded_batch_n(-1)


def test_logprob_of_matches_log_softmax():
    logits = [0.5, 2.0, -1.0, 2.0, 0.0]
    lse = math.log(sum(math.exp(x) for x in logits))
    lp, top = T.logprob_of(logits, 2, 3)
    assert lp == pytest.approx(-1.0 - lse, abs=1e-12)
    # highest first; the tie between ids 1 and 3 keeps the lower id first
    assert [t for t, _ in top] == [1, 3, 0]
    assert top[0][1] == pytest.approx(2.0 - lse, abs=1e-12)
    assert T.logprob_of(logits, 0, 0) == (pytest.approx(0.5 - lse), [])


def test_logprob_of_out_of_vocab_and_empty_give_minus_inf():
    assert T.logprob_of([], 0, 3) == (-math.inf, [])
    lp, top = T.logprob_of([1.0, 2.0], 2, 1)
    assert lp == -math.inf and top[0][0] == 1
    lp, _ = T.logprob_of([1.0, 2.0], -1, 0)
    assert lp == -math.inf


def test_bf16_to_f32_upper_bits():
    for value in (1.0, -2.5, 0.0, 3.140625, float("inf")):
        bits = struct.unpack("<I", struct.pack("<f", value))[0]
        two = struct.pack("<H", bits >> 16)
        assert T.bf16_to_f32(two) == value
    assert T.bf16_to_f32(b"\x80\x3f") == 1.0
    assert math.isnan(T.bf16_to_f32(b"\xc0\x7f"))
    with pytest.raises(ValueError):
        T.bf16_to_f32(b"\x00")


def test_extract_bf16_row():
    vals = [1.0, 3.0, 2.0, -1.0]
    row = b"".join(struct.pack("<H", struct.unpack("<I", struct.pack("<f", v))[0] >> 16)
                   for v in vals)
    got = T.extract_bf16(row, 2, 2)
    lp, top = T.logprob_of(vals, 2, 2)
    assert got.token_id == 2 and got.logprob == pytest.approx(lp)
    assert [t for t, _ in got.top] == [1, 2]
    assert got.rank == 2 and T.extract_bf16(row, 3, 0).rank == 4  # vLLM's rank, top or not
    assert T.extract_bf16(row, 9, 1).rank is None  # outside the vocab
    with pytest.raises(ValueError):
        T.extract_bf16(b"\x00\x00\x00", 0, 1)


def test_row_mask_none_is_u32_max():
    assert T.ROW_MASK_NONE == 2**32 - 1
    mask: T.RowMask = (T.ROW_MASK_NONE, 5)
    assert mask[0] == 0xFFFFFFFF


SEED_FIELDS = {
    "PrefillSlice": ["prompt_tokens", "seq", "chunk_start", "chunk_len", "is_last_chunk"],
    "MixedBatchResult": ["decode", "prefill", "decode_logits", "prefill_logits", "failed",
                         "verified"],
    "MixedForwardResult": ["decode", "prefill", "decode_logits", "prefill_logits"],
    "PrefixReclaim": ["target", "free"],
    "BeamReq": ["tokens", "max_new_tokens", "num_beams", "length_penalty", "early_stopping",
                "src_lang_id", "tgt_lang_id"],
    "VerifyBatchedOpts": ["write_on_accept"],
}


@pytest.mark.parametrize("name", sorted(SEED_FIELDS))
def test_seed_records_have_the_seed_fields_in_order(name):
    import dataclasses

    assert [f.name for f in dataclasses.fields(getattr(T, name))] == SEED_FIELDS[name]


def test_sequence_state_has_every_field_the_scheduler_and_runner_use():
    import dataclasses

    names = {f.name for f in dataclasses.fields(T.SequenceState)}
    assert {"tokens", "block_table", "seq_len", "slot_idx", "rank", "cached_prefix_tokens",
            "cached_prefix_blocks", "reused_prefix_tokens", "prefix_lookup_applied",
            "kv_valid_tokens", "prompt_len", "collect_prompt_logprobs", "prompt_logprobs",
            "sampling", "output_index", "adapter_id"} <= names


def test_seed_enums_have_the_seed_members():
    assert [m.name for m in T.FeedSource] == ["HOST", "DEVICE"]
    assert [m.name for m in T.ForwardSelect] == ["LEGACY", "CIRCUIT"]


SUPERTRAITS = ("ModelForward", "ModelLifecycle", "ModelLogits", "ModelEp", "ModelStreams")


def test_model_is_every_required_supertrait_and_the_optional_ones_are_protocols():
    for name in SUPERTRAITS:
        assert getattr(T, name) in T.Model.__mro__, name
    for name in ("ModelVerify", "ModelDraft", "ModelAdapters", "ModelSsmState",
                 "ModelDeviceFeed", "ModelCircuit", "ModelVision"):
        trait = getattr(T, name)
        assert getattr(trait, "_is_protocol", False) and trait not in T.Model.__mro__, name


def test_a_class_missing_one_trait_method_is_not_a_model(demo_model_dir):
    from epserve import LLM

    runner = LLM(model=str(demo_model_dir), dtype="float32").model
    assert isinstance(runner, T.Model)
    for name in SUPERTRAITS:
        assert isinstance(runner, getattr(T, name)), name

    class Partial:  # every Model method but one, borrowed from the real runner
        pass

    methods = {m for m in dir(T.Model) if not m.startswith("_") and callable(getattr(T.Model, m))}
    for m in methods - {"reserve_blocks"}:
        setattr(Partial, m, getattr(type(runner), m))
    assert not isinstance(Partial(), T.Model)


def test_ep_command_failed_says_its_step_and_rows():
    err = T.EpCommandFailed(7, "unknown sequence (0, 3)", bad_rows=[(0, 3)])
    assert isinstance(err, Exception) and err.step_id == 7 and "step 7" in str(err)
    assert err.bad_rows == ((0, 3),)


def test_prefix_reclaim_reports_short_when_nothing_more_is_evictable():
    """free < target exactly when the pool could not evict enough (the seed's meaning)."""
    from epserve.worker.kv_pool import KVPool

    pool = KVPool(6, 4)
    table = pool.allocate(3)
    pool.cache_blocks(list(range(12)), table, 12, 0)
    pool.free(table)  # 3 cached free blocks, 3 plain free
    held = pool.allocate(3)  # the plain free ones are taken: only cached blocks remain
    got = pool.reclaim_prefix_blocks_for([100, 101, 102, 103, 104], 0, 2, max_tokens=4)
    assert got.target == 2 and got.free >= got.target
    pool.free(held)
    pool2 = KVPool(4, 4)
    pool2.allocate(4)
    short = pool2.reclaim_prefix_blocks_for([1, 2, 3], 0, 2, max_tokens=2)
    assert short.target == 2 and short.free == 0


def test_sequence_state_is_independent_per_instance():
    a, b = T.SequenceState(), T.SequenceState()
    a.tokens.append(1)
    a.block_table.append(3)
    assert b.tokens == [] and b.block_table == []
