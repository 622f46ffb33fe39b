"""The body check every JSON route runs (``deploy.errors.check_json``): bounded depth, finite
numbers, valid Unicode, the same answer as the plain recursive definition on any value, and no
stack entry per token id (it skips members that need no check)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epserve.deploy.errors import ApiError, check_json, parse_json_object


def reference(value, max_depth: int, depth: int = 1) -> str | None:
    """The definition: the first problem met walking members in order (None: fine)."""
    if depth > max_depth:
        return f"the JSON body is nested deeper than {max_depth} levels"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "surrogate"
    elif isinstance(value, float) and not math.isfinite(value):
        return "the JSON body holds a number too large for a float"
    elif isinstance(value, dict):
        for k, item in value.items():
            problem = reference(k, max_depth, depth) or reference(item, max_depth, depth + 1)
            if problem:
                return problem
    elif isinstance(value, list):
        for item in value:
            problem = reference(item, max_depth, depth + 1)
            if problem:
                return problem
    return None


def outcome(value, max_depth: int) -> str | None:
    try:
        check_json(value, max_depth)
    except ApiError as exc:
        assert exc.status == 400
        return "surrogate" if "Unicode" in exc.message else exc.message
    return None


_scalars = (st.integers() | st.booleans() | st.none() | st.text(max_size=4)
            | st.sampled_from(["\ud800", "a\udfff"]) | st.floats(allow_nan=True))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=3) | st.just("\udc00"), inner,
                                         max_size=3), max_leaves=30)


@settings(max_examples=600, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(value=_values, max_depth=st.integers(1, 5))
def test_refuses_exactly_what_the_definition_refuses(value, max_depth):
    # which problem is named first may differ (the walk's order); whether one is found may not
    want, got = reference(value, max_depth), outcome(value, max_depth)
    assert (want is None) == (got is None), (value, max_depth, want, got)
    if want is not None and "deeper" in want and "deeper" in got:
        assert got == want


def test_a_list_of_token_ids_is_checked_for_its_depth_not_pushed_id_by_id():
    ids = list(range(8192))
    check_json({"prompt": ids}, max_depth=3)  # the ids sit at depth 3: members of a list at 2
    with pytest.raises(ApiError, match="deeper than 2 levels"):  # as the definition says
        check_json({"prompt": ids}, max_depth=2)
    assert reference({"prompt": ids}, 2) == "the JSON body is nested deeper than 2 levels"
    with pytest.raises(ApiError, match="deeper than 1 levels"):
        check_json({"prompt": 1}, max_depth=1)
    check_json({"prompt": []}, max_depth=2)  # an empty container has no deeper member
    with pytest.raises(ApiError, match="too large for a float"):
        check_json({"prompt": ids + [math.inf]}, max_depth=3)


def test_parsed_bodies_go_through_the_check():
    assert parse_json_object(b'{"prompt": [1, 2, 3], "n": null}')["prompt"] == [1, 2, 3]
    with pytest.raises(ApiError, match="not valid Unicode"):
        parse_json_object(b'{"prompt": [1, "\\ud800"]}')
