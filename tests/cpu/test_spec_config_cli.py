"""``epserve serve --speculative-config`` with a config it cannot honour exits at once, status 2,
with one ``epserve: error:`` line naming the key (nothing starts: no Ray, no port taken); and
serve.yaml's ``speculative_config`` is refused the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from epserve.deploy.config import AppConfig

TIMEOUT = 120


@pytest.fixture(scope="module")
def env(demo_model_dir) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CUDA_VISIBLE_DEVICES")}
    e["EPSERVE_CACHE_DIR"] = str(demo_model_dir.parent)
    return e


def _serve(env, demo_model_dir, spec: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "epserve", "serve", "--model",
                           str(demo_model_dir), "--port", "1", "--speculative-config", spec],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)


BAD = [
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
     ["speculative_config.prompt_lookup_min", "mtp"]),
    ({"method": "eagle", "num_speculative_tokens": 2}, ["speculative_config.method", "eagle"]),
    ({"method": "nope", "num_speculative_tokens": 2}, ["speculative_config.method", "nope"]),
    ({"method": "ngram", "num_speculative_tokens": 0},
     ["speculative_config.num_speculative_tokens", "got 0"]),
    ({"method": "ngram", "num_speculative_tokens": 17},
     ["speculative_config.num_speculative_tokens", "got 17"]),
    ({"method": "ngram"}, ["speculative_config.num_speculative_tokens", "required"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, ["prompt_lookup_min=4", "prompt_lookup_max=2"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     ["unknown key", "draft_tensor_parallel_size"]),
]


@pytest.mark.parametrize("spec, named", BAD, ids=[json.dumps(b[0]) for b in BAD])
def test_serve_yaml_refuses_a_bad_speculative_config_naming_the_key(demo_model_dir, spec, named):
    """serve.yaml's args (and the CLI's, below) go through the same check."""
    with pytest.raises(ValueError) as err:
        AppConfig.from_dict({"model": str(demo_model_dir), "speculative_config": spec})
    assert all(word in str(err.value) for word in named), str(err.value)


@pytest.mark.parametrize("spec, named", [BAD[0], BAD[3]], ids=["mtp-key", "k"])
def test_serve_refuses_a_bad_speculative_config_naming_the_key(env, demo_model_dir, spec,
                                                               named):
    proc = _serve(env, demo_model_dir, json.dumps(spec))
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epserve: error: "), proc.stderr
    for word in named:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("text, said", [
    ('{"method": "ngram", "num_speculative_tokens": 3', "not JSON"),
    ('[1, 2]', "expected a JSON object"),
])
def test_serve_refuses_speculative_config_that_is_not_a_json_object(env, demo_model_dir,
                                                                    text, said):
    proc = _serve(env, demo_model_dir, text)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("epserve: error: argument --speculative-config: "), lines[0]
    assert said in lines[0]


def test_a_good_speculative_config_is_taken_as_given(demo_model_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    cfg = AppConfig.from_dict({"model": str(demo_model_dir), "speculative_config": spec})
    assert cfg.engine_args().speculative_config == spec
    assert AppConfig.from_dict(cfg.to_dict()).engine.speculative_config == spec
