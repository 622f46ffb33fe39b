"""A chat message's ``content`` checked on the raw JSON: a string, null, or a list of content
parts of which this server serves only ``text`` parts (no vision or audio input).

Invariants: the check runs before pydantic tries the forms of the union, so a client reads
what is wrong with its content (a part type the server refuses, a part with no ``text``, a
value of the wrong JSON type) instead of pydantic's attempt at each form; whatever passes is a
string, null, or a list of ``{"type": "text", "text": str}`` objects, so nothing a client
sends in ``content`` is accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

TEXT_PART_FIELDS = ("type", "text")


def json_type(value: Any) -> str:
    """``value``'s JSON type, as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def _refuse(message: str) -> PydanticCustomError:
    # the message through the context: a client's text may hold braces
    return PydanticCustomError("content", "{message}", {"message": message})


def check_content(value: Any) -> Any:
    """``value`` unchanged when it is content this server serves, else the reason it is not
    (a pydantic error: ``validate`` reports it as ``messages.N.content: <reason>``)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _refuse(f"must be a string, a list of content parts or null, not "
                      f"{json_type(value)}")
    for k, part in enumerate(value):
        if not isinstance(part, dict):
            raise _refuse(f"part {k} must be a content part (an object with a 'type'), not "
                          f"{json_type(part)}")
        if "type" not in part:
            raise _refuse(f"part {k} has no 'type'; only 'text' parts are supported")
        kind = part["type"]
        if not isinstance(kind, str):
            raise _refuse(f"part {k}: 'type' must be a string, not {json_type(kind)}")
        if kind != "text":
            raise _refuse(f"content parts of type {kind[:64]!r} are not supported by this "
                          f"server (no vision or audio input); only 'text' parts")
        if "text" not in part:
            raise _refuse(f"part {k} of type 'text' is missing its 'text' field")
        if not isinstance(part["text"], str):
            raise _refuse(f"part {k}: 'text' must be a string, not {json_type(part['text'])}")
        extra = [f for f in part if f not in TEXT_PART_FIELDS]
        if extra:
            raise _refuse(f"part {k}: this server does not support the field "
                          f"{str(extra[0])[:64]!r} of a content part")
    return value


__all__ = ["TEXT_PART_FIELDS", "check_content", "json_type"]
