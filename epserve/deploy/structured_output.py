"""Structured output at the HTTP edge: ``response_format`` and vLLM's ``structured_outputs``
(chat and completions alike, as vLLM's) as one ``StructuredOutputsParams``.

Invariants: what a request asks is checked here, before anything is queued, by the one
definition of a valid constraint (``head.structured_params``: xgrammar parses it); an invalid
schema, regex or grammar is a 400 whose ``param`` is the field the client used
(``response_format`` or ``structured_outputs``) and whose message says what is wrong; both
fields at once, or a ``response_format`` type this server does not know, is a 400 too.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from epserve.deploy.errors import bad_request
from epserve.head.structured_params import StructuredOutputsParams

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)  # vLLM's coercions
_HINTS = get_type_hints(StructuredOutputsParams)


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's name, description, schema and strict."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# vLLM's ``structured_outputs`` request field: ``StructuredOutputsParams``'s own fields (``json``
# under another attribute name: a pydantic model has a ``json`` method) but the server's own
# ``enable_in_reasoning`` (vLLM's request has no such field: a 400 names it)
StructuredOutputs = create_model(
    "StructuredOutputs", __config__=_STRICT,
    **{(f.name + "_" if f.name == "json" else f.name): (
        _HINTS[f.name], Field(f.default, alias=f.name)) for f in fields(StructuredOutputsParams)
       if f.name != "enable_in_reasoning"})


def _set_fields(so: BaseModel) -> dict[str, Any]:
    return {k: v for k, v in so.model_dump(by_alias=True).items()
            if v is not None and v is not False}


def structured_fields(req: Any) -> dict[str, Any] | None:
    """The request's constraint as ``StructuredOutputsParams`` fields (how they travel to
    the engine), None when it has none; a 400 naming the field when it is invalid."""
    fmt: ResponseFormat | None = getattr(req, "response_format", None)
    so: BaseModel | None = getattr(req, "structured_outputs", None)
    if fmt is not None and fmt.type != "text":
        if so is not None:
            raise bad_request("send response_format or structured_outputs, not both",
                              param="response_format")
        if fmt.type == "json_object":
            if fmt.json_schema is not None:
                raise bad_request("response_format.json_schema is for type json_schema",
                                  param="response_format")
            return _checked({"json_object": True}, "response_format", "response_format.json_schema")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format.json_schema.schema is required for type "
                              "json_schema", param="response_format")
        return _checked({"json": fmt.json_schema.schema_}, "response_format",
                        "response_format.json_schema")
    if fmt is not None and fmt.json_schema is not None:
        raise bad_request("response_format.json_schema is for type json_schema",
                          param="response_format")
    return None if so is None else _checked(_set_fields(so), "structured_outputs",
                                            "structured_outputs")


def _checked(fields: dict[str, Any], param: str, where: str) -> dict[str, Any]:
    """``fields`` when they make a valid constraint, else a 400 (``param``) whose message
    names the field as the client wrote it (``where``)."""
    try:
        StructuredOutputsParams(**fields)
    except ValueError as exc:
        msg = str(exc).replace("SamplingParams.structured_outputs", where)
        if where != "structured_outputs":  # the schema sits under another name there
            msg = msg.replace(f"{where}.json ", f"{where}.schema ")
        raise bad_request(msg, param=param) from None
    return fields


def responses_text_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    """The Responses API's ``text.format`` (``json_schema`` flattened: name, schema, strict
    beside the type) as chat's ``response_format``, None for text; a 400 (``param`` text)
    when it is invalid."""
    kind = fmt.get("type", "text")
    if kind == "text" and len(fmt) <= 1:
        return None
    if kind == "json_schema":
        chat = {"type": kind, "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    else:
        chat = dict(fmt)
    try:
        parsed = ResponseFormat.model_validate(chat)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "json_schema")
        raise bad_request(f"text.format.{loc}: {err.get('msg')}", param="text") from None
    if parsed.type == "json_object":
        _checked({"json_object": True}, "text", "text.format")
    elif parsed.json_schema.schema_ is None:
        raise bad_request("text.format.schema is required for type json_schema", param="text")
    else:
        _checked({"json": parsed.json_schema.schema_}, "text", "text.format")
    return chat
