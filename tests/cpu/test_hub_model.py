"""``--model`` as a Hugging Face hub id, resolved through huggingface_hub's cache with
HF_HUB_OFFLINE set (nothing downloaded): the same outputs as the folder itself, the id as the
served name; an id the cache lacks is one clear error."""

from __future__ import annotations

import shutil

import pytest

from epserve import LLM, SamplingParams
from epserve.cluster.engine_args import EngineArgs
from epserve.models.config import CheckpointError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch, demo_model_dir):
    """A hub cache holding ``epserve-test/tiny-moe`` (the demo checkpoint), in the layout
    huggingface_hub writes: refs/main naming a snapshot folder of the files."""
    repo = tmp_path / "hub" / "models--epserve-test--tiny-moe"
    snap = repo / "snapshots" / COMMIT
    shutil.copytree(demo_model_dir, snap, ignore=shutil.ignore_patterns(".epserve-*"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snap


def test_a_hub_id_serves_the_cached_snapshot(hub_cache, demo_model_dir):
    args = EngineArgs(model="epserve-test/tiny-moe").resolved()
    assert args.model == str(hub_cache) and args.served_model_name == "epserve-test/tiny-moe"
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    by_id = LLM(model="epserve-test/tiny-moe", dtype="float32").generate(["Hello"], sp)
    by_dir = LLM(model=str(demo_model_dir), dtype="float32").generate(["Hello"], sp)
    assert by_id[0].outputs[0].token_ids == by_dir[0].outputs[0].token_ids


def test_an_id_the_cache_lacks_is_one_clear_error(hub_cache):
    with pytest.raises(CheckpointError, match="no-such/model: no such folder, and "
                                              "HF_HUB_OFFLINE is set"):
        LLM(model="no-such/model")


def test_a_folder_is_never_looked_up(tmp_path, demo_model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert EngineArgs(model=str(demo_model_dir)).resolved().model == str(demo_model_dir)
    with pytest.raises(CheckpointError, match="no such folder"):  # a path, not an id
        LLM(model=str(tmp_path / "missing"))
