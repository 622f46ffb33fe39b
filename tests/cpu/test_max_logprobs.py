"""``max_logprobs`` as vLLM's option: 20 by default, -1 = the vocabulary size, any other bound
as configured; every rank's validator and the rank-result codec hold commands to the engine's
bound (not a fixed 20), and under expert parallelism a bound whose results could not fit a
rank's result frame is refused at start, naming the option."""

from __future__ import annotations

import pytest

from epserve import LLM, SamplingParams
from epserve.cluster.engine_args import EngineArgs, check_logprobs_fit
from epserve.models.traits import EpCommandFailed, PromptTokenLogprob, RowSampling, SampledToken
from epserve.worker import ep_results as R
from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import NewSeq, ProtocolError, StepCommand, WireLimits

PROMPT = {"prompt_token_ids": [3, 9, 27, 81]}


def test_minus_one_is_the_vocabulary(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="float32", max_model_len=32, max_logprobs=-1)
    vocab = llm.model.vocab_size()
    assert llm.engine.cfg.limits.max_logprobs == vocab > 20
    assert llm.model.rank0.mirror.max_logprobs == vocab  # the rank's own bound
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=2, logprobs=vocab,
                                                 prompt_logprobs=vocab, temperature=0))
    assert [len(d) for d in out.outputs[0].logprobs] == [vocab, vocab]
    assert all(len(d) == vocab for d in out.prompt_logprobs[1:])
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be <= {vocab} "
                                             rf"\(max_logprobs\)"):
            llm.generate(PROMPT, SamplingParams(max_tokens=1, **{field: vocab + 1}))


def test_the_bound_reaches_the_ranks_and_the_result_codec():
    mirror = EpMirror(world_size=2, num_blocks=8, block_size=4, max_slots=4,
                      max_blocks_per_seq=4, vocab_size=100, max_logprobs=30)
    mirror.validate(StepCommand(step_id=0, new_seqs=(
        NewSeq(1, 0, 0, 3, 30, RowSampling(logprobs=30)),)))
    for new in (NewSeq(1, 1, 0, 3, 31, RowSampling()),
                NewSeq(1, 1, 0, 3, -1, RowSampling(logprobs=31))):
        with pytest.raises(EpCommandFailed, match="logprobs") as e:
            mirror.validate(StepCommand(step_id=1, new_seqs=(new,)))
        assert e.value.bad_rows == ((1, 1),)
        mirror.next_step = 1
    limits = WireLimits(2, 4, 4, max_logprobs=30)

    def result(k: int) -> bytes:
        top = tuple((t, -1.0) for t in range(k))
        return R.encode_result(R.RankResult(0, 1, {2: SampledToken(5, -0.5, top)},
                                            {2: [PromptTokenLogprob(7, -1.0, top)]}))
    assert len(R.decode_result(result(30), limits).sampled[2].top) == 30
    with pytest.raises(ProtocolError, match="entry count"):
        R.decode_result(result(31), limits)


def test_over_ep_a_bound_beyond_the_result_frame_is_refused_at_start():
    most = R.max_logprobs_in_frame(2048)
    assert 1000 < most < 151936  # a real vocabulary does not fit, a small one does
    args = EngineArgs(ep_size=2, max_logprobs=-1, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match=rf"^max_logprobs=-1 \(151936 alternatives per token\) "
                                         rf"exceeds {most}.*max_num_batched_tokens"):
        check_logprobs_fit(args, 151936)
    check_logprobs_fit(args, most)
    check_logprobs_fit(EngineArgs(max_logprobs=-1), 151936)  # one rank: no frame
    assert 2048 * (R._ENTRY.itemsize + most * R._TOP.itemsize) < R.MAX_FRAME_BYTES


def test_the_serve_flag_takes_minus_one():
    from epserve.deploy.cli import _parser
    from epserve.deploy.server import config_from_args

    args = _parser().parse_args(["serve", "--max-logprobs", "-1", "--max-logit-bias", "7"])
    engine = config_from_args(args).engine
    assert (engine.max_logprobs, engine.max_logit_bias) == (-1, 7)
    assert engine.request_limits(vocab_size=500).max_logprobs == 500
