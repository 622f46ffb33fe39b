"""One ``StepModel`` is the whole ``Model`` at every ep_size: every trait method is there
(``isinstance(m, Model)`` at ep_size 1, 2 and 3), and the seed's forward forms run the same
step as ``mixed_forward_batch``: a prefill then decodes over N ranks give the one-rank tokens."""

from __future__ import annotations

import pytest

from epserve.cluster.engine_args import EngineArgs
from epserve.models.traits import Model, RowSampling
from tiny_ckpt import make_tiny_checkpoint

PROMPT = [5, 9, 2, 7, 7, 3, 11, 4, 6]


@pytest.fixture(scope="module")
def ckpt6(tmp_path_factory):
    return make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("m6"), num_experts=6)


def _greedy_run(model) -> list[int]:
    """Prefill PROMPT, then four decodes, through the seed's forms only."""
    seq = model.alloc_sequence_for(64, PROMPT)
    seq.sampling = RowSampling(temperature=0.0)
    seq.prompt_len = len(PROMPT)
    assert model.reserve_blocks(seq, len(PROMPT) + 1)
    got = [model.prefill(PROMPT, seq).token_id]
    for _ in range(4):
        seq.output_index = len(got)
        assert model.reserve_blocks(seq, seq.seq_len + 1)
        got.append(model.decode(got[-1], seq).token_id)
    model.free_sequence(seq)
    return got


def test_the_one_rank_model_is_a_model(ckpt6):
    from epserve.worker.step_model import StepModel

    model = StepModel.one_rank(EngineArgs(model=str(ckpt6), dtype="float32").resolved()
                               .runner_config())
    assert isinstance(model, Model)
    assert len(_greedy_run(model)) == 5


@pytest.mark.parametrize("ep_size", [2, 3])
def test_the_ep_model_is_a_model_and_its_forms_match_one_rank(ray_cluster, ckpt6, ep_size):
    from ray.util.placement_group import placement_group, remove_placement_group

    from epserve.cluster.ep_group import EpGroup, bundle
    from epserve.worker.step_model import StepModel

    args = EngineArgs(model=str(ckpt6), dtype="float32", ep_size=ep_size).resolved()
    want = _greedy_run(StepModel.one_rank(EngineArgs(model=str(ckpt6), dtype="float32")
                                          .resolved().runner_config()))
    pg = placement_group([bundle("cpu")] * ep_size, strategy="STRICT_PACK")
    ray_cluster.get(pg.ready(), timeout=60)
    group = EpGroup(args, pg)
    group.join()
    try:
        assert isinstance(group.leader, Model) and type(group.leader) is StepModel
        assert _greedy_run(group.leader) == want
    finally:
        group.shutdown(graceful=True)
        remove_placement_group(pg)
