"""A reasoning model that would think forever: the HTTP tests' scripted model
(tests/http/scripted_model.py: its next token is a function of the last one) with one change,
after ``</think>`` its script goes back to ``<think>``. The closed-thinking tests (tests/cpu,
tests/ray) run it with and without the reasoning parser."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SCRIPTED = Path(__file__).resolve().parent / "http" / "scripted_model.py"
LOOP = ["<think>", "Hmm.", "</think>"]


def scripted_module():
    spec = importlib.util.spec_from_file_location("scripted_model_for_loop", _SCRIPTED)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_looping_checkpoint(folder: Path, demo_model_dir: Path) -> Path:
    """The scripted checkpoint (trigger ``[[loop]]``) whose ``</think>`` is followed by
    ``<think>`` (not the end), under ``folder``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    sm = scripted_module()
    out = sm.make_scripted_checkpoint(folder, demo_model_dir, {"[[loop]]": LOOP}, ["Ok."],
                                      ["Ok!"])
    tok = AutoTokenizer.from_pretrained(str(out))
    start, end, eos = tok.convert_tokens_to_ids(["<think>", "</think>", sm.IM_END])
    path = next(out.glob("*.safetensors"))
    weights = load_file(str(path))
    emb, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    col = int(emb[end].argmax())  # "</think>"'s one-hot column
    head[eos, col], head[start, col] = 0.0, 10.0
    save_file(weights, str(path), metadata={"format": "pt"})
    return out
