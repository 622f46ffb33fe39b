"""StopChecker: stop ids/EOS with min_tokens gating, length, stop strings across deltas."""

import pytest
from hypothesis import given, settings, strategies as st

from epserve.head.stop_automaton import StopAutomaton
from epserve.head.stops import StopChecker

EOS = 2


def make(stop=(), stop_ids=(), ignore_eos=False, min_tokens=0, max_tokens=100, include=False):
    return StopChecker(stop=tuple(stop), stop_token_ids=frozenset(stop_ids), eos_token_ids=frozenset({EOS}),
                       ignore_eos=ignore_eos, min_tokens=min_tokens, max_tokens=max_tokens,
                       include_stop_str_in_output=include)


def test_eos_and_stop_ids():
    c = make(stop_ids=[7])
    assert c.check_token(5, 1) == (None, None)
    assert c.check_token(EOS, 1) == ("stop", None)
    assert c.check_token(7, 1) == ("stop", 7)


def test_ignore_eos():
    c = make(stop_ids=[7], ignore_eos=True)
    assert c.check_token(EOS, 3) == (None, None)
    assert c.check_token(7, 3) == ("stop", 7)
    assert c.banned_ids(0) == ()


def test_max_tokens_gives_length_and_stop_wins():
    c = make(max_tokens=4)
    assert c.check_token(5, 3) == (None, None)
    assert c.check_token(5, 4) == ("length", None)
    assert c.check_token(EOS, 4) == ("stop", None)


def test_min_tokens_gates_eos_and_stop_ids():
    c = make(stop_ids=[7, 9], min_tokens=3)
    for n in (1, 2):
        assert c.check_token(EOS, n) == (None, None)
        assert c.check_token(7, n) == (None, None)
    assert c.check_token(EOS, 3) == ("stop", None)
    assert c.check_token(9, 3) == ("stop", 9)


def test_banned_ids_under_min_tokens():
    c = make(stop_ids=[9, 7], min_tokens=2)
    assert c.banned_ids(0) == (EOS, 7, 9)
    assert c.banned_ids(1) == (EOS, 7, 9)
    assert c.banned_ids(2) == ()
    assert make(stop_ids=[7], min_tokens=2, ignore_eos=True).banned_ids(0) == (7,)
    assert make().banned_ids(0) == ()


def test_stop_string_cut_before_or_after():
    text = "hello STOP world"
    assert make(stop=["STOP"]).check_text(text, len(text)) == 6
    assert make(stop=["STOP"], include=True).check_text(text, len(text)) == 10
    assert make(stop=["STOP"]).find_stop(text, len(text)) == (6, "STOP")
    assert make(stop=["nope"]).check_text(text, len(text)) is None
    assert make().check_text(text, len(text)) is None


def test_first_ending_stop_wins():
    assert make(stop=["world", "lo"]).find_stop("hello world", 11) == (3, "lo")
    assert make(stop=["abcd", "bc"]).find_stop("abcd", 4) == (1, "bc")
    assert make(stop=["c", "ca"], include=True).find_stop("ca", 2) == (1, "c")


def test_stop_string_across_deltas():
    c = make(stop=["<end>"])
    text = ""
    found = None
    for delta in ["abc<", "e", "nd", ">tail"]:
        text += delta
        found = c.check_text(text, len(delta))
        if found is not None:
            break
    assert text[:found] == "abc"


def test_search_is_limited_to_the_tail():
    c = make(stop=["ab"])
    # "ab" lies far before the delta: it was (or would have been) found by an earlier check.
    assert c.check_text("ab" + "x" * 50 + "yz", 2) is None
    assert c.check_text("x" * 50 + "a" + "b", 1) == 50


def test_stop_strings_gated_by_min_tokens_when_told():
    # vLLM's rule: stop strings count once there are more than min_tokens tokens
    c = make(stop=["x"], min_tokens=3)
    assert c.check_text("ax", 1, num_generated=3) is None
    assert c.check_text("axx", 1, num_generated=4) == 2
    assert make(stop=["x"], min_tokens=3).check_text("ax", 1) == 1
    assert make(stop=["x"], min_tokens=1).check_text("x", 1, num_generated=1) is None


def test_safe_stream_len():
    c = make(stop=["STOP", "END"])
    assert c.safe_stream_len("hello ST") == 6
    assert c.safe_stream_len("hello E") == 6
    assert c.safe_stream_len("hello S") == 6
    assert c.safe_stream_len("hello") == 5
    assert c.safe_stream_len("") == 0
    assert make(stop=["STOP"], include=True).safe_stream_len("hello ST") == 8
    assert make().safe_stream_len("abc") == 3


def _stream(c, text, cuts):
    """Feed text in deltas of the given sizes; return (cut index or None, safe lengths seen)."""
    pos, safes = 0, []
    for step in cuts:
        if pos >= len(text):
            break
        delta = text[pos:pos + step]
        pos += len(delta)
        cut = c.check_text(text[:pos], len(delta))
        if cut is not None:
            return cut, safes
        safes.append((pos, c.safe_stream_len(text[:pos])))
    return None, safes


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       cuts=st.lists(st.integers(1, 6), max_size=30), include=st.booleans())
def test_delta_sizes_do_not_change_the_cut(text, stops, cuts, include):
    c = make(stop=stops, include=include)
    want, _ = _stream(c, text, [1] * len(text))
    got, safes = _stream(c, text, cuts + [len(text)])
    assert got == want
    if want is None:
        assert not any(s in text for s in stops)
    else:
        shown = text[:want]
        # Cut text holds no stop string, or (include) exactly one, at its very end.
        body = shown if not include else shown[:-1]
        assert not any(s in body for s in stops)
    for pos, safe in safes:
        # Streamed text never holds anything that could still turn out to be cut away.
        assert safe <= pos and (want is None or safe <= want)


def _first_stop_by_char(text, token_ends, stops, min_tokens, include):
    """The spec, checked after every single character: the first position where a stop ends
    (the longest of those ending there), counting only characters of tokens n > min_tokens."""
    n_at = []  # output tokens existing when each character appeared
    prev = 0
    for n, end in enumerate(token_ends, start=1):
        n_at += [n] * (end - prev)
        prev = end
    for p in range(1, len(text) + 1):
        if n_at[p - 1] <= min_tokens:
            continue
        ending = [s for s in stops if text[:p].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return (p if include else p - len(s)), s
    return None


def _held_back(text, stops):
    """The spec of safe_stream_len: the longest suffix that is a proper prefix of a stop."""
    return max((k for s in stops for k in range(len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=400, deadline=None)
@given(text=st.text(alphabet="ab\u00e9\U0001f600", max_size=40),
       stops=st.lists(st.text(alphabet="ab\u00e9\U0001f600", min_size=1, max_size=5),
                      min_size=1, max_size=6, unique=True),
       cuts=st.lists(st.integers(1, 5), max_size=40), include=st.booleans(),
       min_tokens=st.integers(0, 6))
def test_matches_the_per_character_spec(text, stops, cuts, include, min_tokens):
    c = make(stop=stops, include=include, min_tokens=min_tokens)
    ends, pos = [], 0
    for step in cuts + [len(text)]:
        if pos >= len(text):
            break
        pos = min(len(text), pos + step)
        ends.append(pos)
    want = _first_stop_by_char(text, ends, stops, min_tokens, include)
    got, before = None, 0
    for n, end in enumerate(ends, start=1):
        got = c.find_stop(text[:end], end - before, n)
        before = end
        if got is not None:
            break
        if not include:
            assert c.safe_stream_len(text[:end]) == end - _held_back(text[:end], stops)
    assert got == want


def test_a_stop_completed_under_min_tokens_does_not_stop_later():
    c = make(stop=["abc", "x"], min_tokens=3)
    text = ""
    for n, delta in enumerate(["x", "y", "z"], start=1):
        text += delta
        assert c.find_stop(text, 1, n) is None
        # a whole stop under min_tokens is plain text: nothing of it is held back
        assert c.safe_stream_len(text) == len(text)
    text += "x"
    assert c.find_stop(text, 1, 4) == (3, "x")


def test_completions_share_one_automaton_and_keep_their_own_state():
    stops = ("<end>", "STOP")
    a = StopAutomaton(stops)
    one, two = (StopChecker(stop=stops, stop_token_ids=frozenset(), eos_token_ids=frozenset(),
                            ignore_eos=False, min_tokens=0, max_tokens=100,
                            include_stop_str_in_output=False, automaton=a) for _ in range(2))
    t1, t2 = "", ""
    for d1, d2 in [("ab<e", "ST"), ("n", "O"), ("d>", "x")]:
        t1, t2 = t1 + d1, t2 + d2
        r1, r2 = one.find_stop(t1, len(d1)), two.find_stop(t2, len(d2))
    assert r1 == (2, "<end>") and r2 is None
    assert two.safe_stream_len(t2) == len(t2)
    with pytest.raises(ValueError):
        StopChecker(stop=("other",), stop_token_ids=frozenset(), eos_token_ids=frozenset(),
                    ignore_eos=False, min_tokens=0, max_tokens=100,
                    include_stop_str_in_output=False, automaton=a)


def test_ten_thousand_stops_answer_like_the_one_that_matches():
    """Many stops that never occur change no answer (their cost is test_request_limits')."""
    many = [f"stop{i:05d}" for i in range(10_000)] + ["END"]
    c, one = make(stop=many), make(stop=["END"])
    text = ""
    for delta in ["hello ", "wor", "ld E", "N", "D!"]:
        text += delta
        assert c.find_stop(text, len(delta)) == one.find_stop(text, len(delta))
        assert c.safe_stream_len(text) == one.safe_stream_len(text)
    assert c.find_stop(text, 0) is None


def test_rejects_bad_config():
    with pytest.raises(ValueError):
        make(stop=[""])
    with pytest.raises(ValueError):
        make(max_tokens=0)
