"""The built-in demo model: built once into the cache, reused, loadable by transformers."""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from epserve.models import demo

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("epserve-cache")
    t0 = time.perf_counter()
    path = demo.demo_model_path(cache, progress=False)
    return path, time.perf_counter() - t0


def test_builds_quickly_into_the_cache_folder(built):
    path, seconds = built
    assert path.name == demo.DEMO_NAME and demo.is_complete(path)
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")], "temp dir left over"
    assert seconds < 30, f"demo build took {seconds:.1f}s"


def test_second_call_reuses_the_build(built):
    path, _ = built
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    t0 = time.perf_counter()
    assert demo.demo_model_path(path.parent, progress=False) == path
    assert time.perf_counter() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_env_var_chooses_the_cache(built, monkeypatch):
    path, _ = built
    monkeypatch.setenv(demo.CACHE_ENV, str(path.parent))
    assert demo.default_cache_dir() == path.parent
    assert demo.demo_model_path(progress=False) == path


def test_half_built_folder_is_replaced_and_progress_shows(tmp_path, capsys):
    broken = tmp_path / demo.DEMO_NAME
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    path = demo.demo_model_path(tmp_path, progress=True)
    assert path == broken and demo.is_complete(path)
    json.loads((path / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == [demo.DEMO_NAME]
    err = capsys.readouterr().err
    assert "building demo model" in err and "Writing model shards" not in err


def test_abandoned_temp_folders_are_cleaned(tmp_path):
    old = tmp_path / f".{demo.DEMO_NAME}.tmp-crashed"
    fresh = tmp_path / f".{demo.DEMO_NAME}.tmp-building-now"
    old.mkdir()
    fresh.mkdir()
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    demo.demo_model_path(tmp_path, progress=False)
    assert not old.exists() and fresh.exists(), "only the hour-old one is abandoned"


def test_losing_the_install_race_keeps_the_winner(built, tmp_path):
    winner = tmp_path / demo.DEMO_NAME
    shutil.copytree(built[0], winner)
    before = (winner / "model.safetensors").stat().st_ino
    loser = tmp_path / "loser"
    shutil.copytree(built[0], loser)
    demo._install(loser, winner)  # what a second process does after building its own copy
    assert (winner / "model.safetensors").stat().st_ino == before, "the winner stays"
    assert demo.is_complete(winner)


def test_racing_builders_agree(tmp_path, capsys):
    with ThreadPoolExecutor(3) as pool:
        paths = list(pool.map(lambda _: demo.demo_model_path(tmp_path, progress=False), range(3)))
    assert paths == [tmp_path / demo.DEMO_NAME] * 3 and demo.is_complete(paths[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == [demo.DEMO_NAME]
    transformers.AutoTokenizer.from_pretrained(paths[0])
    assert capsys.readouterr().err == "", "progress=False prints nothing"


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines\r\n",
    "Ünïcödé: 日本語のテキスト, Ελληνικά, العربية, emoji 🙂🚀👩‍💻, math ∑∫√",
    "\x00\x01 control bytes \x7f and a lone combining mark \u0301",
    "<|im_start|> special tokens inside text <|im_end|>",
])
def test_tokenizer_round_trips_any_text(built, text):
    tok = transformers.AutoTokenizer.from_pretrained(built[0])
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert max(ids) < tok.vocab_size + len(tok.get_added_vocab())


def test_tokenizer_vocab_and_special_tokens(built):
    tok = transformers.AutoTokenizer.from_pretrained(built[0])
    assert len(tok) == demo.TOKENIZER_VOCAB
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = tok.encode("<|im_start|>user", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>"), "special tokens are single ids"
    # Real English compresses: BPE learned merges, not just the byte alphabet.
    text = "The server streams the new text back to the client."
    assert len(tok.encode(text, add_special_tokens=False)) < len(text) / 2.5


def test_chat_template_renders_chatml(built):
    tok = transformers.AutoTokenizer.from_pretrained(built[0])
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[:1], tokenize=False)
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_config_has_the_demo_shape(built):
    path, _ = built
    raw = json.loads((path / "config.json").read_text())
    assert raw["num_experts"] == 16 and "num_local_experts" not in raw, "hub-style keys"
    cfg = transformers.AutoConfig.from_pretrained(path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert cfg.model_type == "qwen3_moe"
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tok)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 8, 2, 32)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.intermediate_size) == (16, 4, 128, 512)
    assert cfg.max_position_embeddings == 4096 and cfg.norm_topk_prob is True
    assert cfg.tie_word_embeddings is False and cfg.bos_token_id is None
    assert cfg.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id


def test_weights_load_and_generate(built):
    import torch

    path, _ = built
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0, "random, not zero, weights"
