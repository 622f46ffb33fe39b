"""Bounded work per request, as a user of the offline API and the ``epserve`` command sees it:
a request over a limit (n, stop strings, stop ids, logprobs) is refused with a ``ValueError``
naming the field and leaves no trace; the limits are engine options; and a request with the
most stop strings allowed hardly slows the others (stop matching reads only new text).
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time

import pytest

from epserve import LLM, SamplingParams
from epserve.cluster.engine_args import EngineArgs, build_engine
from epserve.head.limits import RequestLimits

DEFAULTS = RequestLimits()


def _max_stops(seed: int = 0) -> list[str]:
    """The most stop strings the defaults allow, of the most characters: text-like prefixes
    (so they partly match what the model writes) that end in a character it never writes."""
    rnd = random.Random(seed)
    size = DEFAULTS.max_stop_chars // DEFAULTS.max_stop_strings
    return ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(size - 1)) + "\u2603"
            for _ in range(DEFAULTS.max_stop_strings)]


@pytest.fixture(scope="module")
def llm(demo_model_dir) -> LLM:
    # the demo model has a real tokenizer: stop strings are matched against real text
    return LLM(model=str(demo_model_dir), dtype="float32", seed=0)


@pytest.mark.parametrize("kw, field", [
    (dict(n=DEFAULTS.max_n + 1), "n"),
    (dict(stop=[f"s{i}" for i in range(DEFAULTS.max_stop_strings + 1)]), "stop"),
    (dict(stop=["x" * (DEFAULTS.max_stop_chars // 2), "y" * (DEFAULTS.max_stop_chars // 2 + 1)]),
     "stop"),
    (dict(stop_token_ids=list(range(DEFAULTS.max_stop_token_ids + 1))), "stop_token_ids"),
])
def test_over_a_default_limit_is_refused_naming_the_field(llm, kw, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} ") as e:
        llm.generate("Hello", SamplingParams(max_tokens=2, **kw))
    assert "max_" in str(e.value)  # names the option that would allow it
    assert not llm.engine.requests and not llm.engine.has_unfinished()
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        next(llm.stream("Hello", SamplingParams(max_tokens=2, **kw)))


def test_at_every_default_limit_is_accepted():
    DEFAULTS.check(SamplingParams(n=DEFAULTS.max_n, stop=_max_stops(),
                                  stop_token_ids=list(range(DEFAULTS.max_stop_token_ids)),
                                  logprobs=DEFAULTS.max_logprobs,
                                  prompt_logprobs=DEFAULTS.max_logprobs))


def test_limits_are_engine_options(demo_model_dir):
    args = EngineArgs(model=str(demo_model_dir), dtype="float32", max_n=2, max_stop_strings=1,
                      max_stop_chars=4, max_stop_token_ids=1, max_logprobs=3)
    engine = build_engine(args)[0]
    for kw, field in [(dict(n=3), "n"), (dict(stop=["a", "b"]), "stop"),
                      (dict(stop=["abcde"]), "stop"),
                      (dict(stop_token_ids=[5, 6]), "stop_token_ids"),
                      (dict(logprobs=4), "logprobs"), (dict(prompt_logprobs=4), "prompt_logprobs")]:
        with pytest.raises(ValueError, match=rf"^SamplingParams\.{field} "):
            engine.add_request(None, [5, 6, 7], SamplingParams(**kw))
    assert not engine.requests
    engine.add_request(None, [5, 6, 7], SamplingParams(n=2, stop=["abcd"], stop_token_ids=[5],
                                                       logprobs=3, prompt_logprobs=3))


@pytest.mark.parametrize("kw, option", [
    (dict(max_n=0), "max_n"), (dict(max_stop_strings=-1), "max_stop_strings"),
    (dict(max_stop_chars="8"), "max_stop_chars"),
    (dict(max_stop_token_ids=True), "max_stop_token_ids"),
    (dict(max_logprobs=-2), "max_logprobs"), (dict(max_logprobs=1.5), "max_logprobs"),
])
def test_bad_limit_options_are_refused_naming_them(kw, option):
    with pytest.raises(ValueError, match=rf"^{option} must"):
        EngineArgs(**kw)


def test_serve_flags_reach_the_engine_args():
    from epserve.deploy.cli import _parser
    from epserve.deploy.server import config_from_args

    args = _parser().parse_args(["serve", "--max-n", "4", "--max-stop-strings", "3",
                                 "--max-stop-chars", "99", "--max-stop-token-ids", "7",
                                 "--max-logprobs", "5"])
    e = config_from_args(args).engine
    assert e.request_limits() == RequestLimits(max_n=4, max_stop_strings=3, max_stop_chars=99,
                                               max_stop_token_ids=7, max_logprobs=5)
    assert config_from_args(_parser().parse_args(["serve"])).engine.request_limits() == DEFAULTS
    proc = subprocess.run([sys.executable, "-m", "epserve", "serve", "--max-logprobs", "-2"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "max_logprobs must be" in proc.stderr, proc.stderr


def _median_step(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()  # with outputs, as the server streams them
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def test_the_most_stop_strings_hardly_slow_a_concurrent_request(llm):
    """An innocent request's step time beside a request with the most stop strings (and many
    choices, each checked every step) vs beside the same request without stop strings: the
    stop strings may not double it. Rounds interleave the two and medians absorb a loaded
    machine; the old check (every stop string, every step) made it ~3x here."""
    engine, tok = llm.engine, llm.get_tokenizer()
    ids = tok.encode("Once upon a time")
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=4000)
    engine.add_request("innocent", ids, SamplingParams(**greedy))
    n = 32
    twins = {"plain": SamplingParams(n=n, **greedy),
             "max-stops": SamplingParams(n=n, stop=_max_stops(), **greedy)}
    times: dict[str, list[float]] = {k: [] for k in twins}
    _median_step(engine, 3)
    try:
        for r in range(6):
            for name in (list(twins) if r % 2 == 0 else list(twins)[::-1]):
                engine.add_request(f"{name}-{r}", ids, twins[name])
                _median_step(engine, 2)  # its prefill, and the automaton's build
                times[name].append(_median_step(engine, 8))
                engine.abort_request(f"{name}-{r}")
                out = engine.step()  # the innocent goes on untouched
                assert [o.request_id for o in out] == ["innocent"]
    finally:
        engine.abort_request("innocent")
    plain, hostile = statistics.median(times["plain"]), statistics.median(times["max-stops"])
    assert hostile < 2 * plain, (f"median step {hostile * 1e3:.1f} ms beside the max-stops "
                                 f"request vs {plain * 1e3:.1f} ms beside its plain twin")
