"""``StructuredOutputsParams``: what a request's output must match (vLLM's ``structured_outputs``).

Owns the one definition of a valid constraint, wherever it comes from (the HTTP edge's
``response_format`` and ``structured_outputs``, the offline ``LLM``, the head on receipt).
Invariants: an instance that exists holds exactly one constraint (``json``, ``json_object``,
``regex``, ``choice`` or ``grammar``), bounded in size, that xgrammar parses: an invalid
schema, regex or grammar is a ``ValueError`` naming the field and xgrammar's reason, never
accepted and ignored. ``grammar`` is EBNF as xgrammar reads it (GBNF: ``root ::= ...``).
Options vLLM has and this engine does not (``whitespace_pattern``, ``structural_tag``,
``disable_additional_properties``) are refused, not dropped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: The most characters a constraint may hold (a schema as JSON text, a regex, a grammar, the
#: choices together): compiling one costs the engine work that grows with it.
MAX_SPEC_CHARS = 65536
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


def xgrammar_reason(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    return _XGRAMMAR_PREFIX.sub("", str(exc)).strip() or type(exc).__name__


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutputsParams:
    """One constraint on a request's output. ``json``: a JSON schema (dict or its JSON text);
    ``json_object``: any JSON object; ``regex``; ``choice``: one of these strings; ``grammar``:
    EBNF. ``disable_any_whitespace``: JSON without free whitespace between tokens.
    ``disable_fallback``: accepted either way (this engine never falls back).
    ``enable_in_reasoning``: with the engine's reasoning parser, the constraint holds inside
    the thinking block too (vLLM's engine option of that name, here per constraint; a forced
    tool call sets it); by default it holds once the reasoning has ended."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise _bad(name, "is not supported by this server")
        if self.disable_additional_properties is not False:
            raise _bad("disable_additional_properties", "is not supported by this server")
        for name in ("disable_fallback", "disable_any_whitespace", "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "must be a bool")
        if self.json_object not in (None, True, False):
            raise _bad("json_object", "must be a bool")
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("SamplingParams.structured_outputs: set exactly one of json, "
                             f"json_object, regex, choice, grammar (got {set_ or 'none'})")
        self._check_shape(set_[0])
        parse_grammar(self)  # xgrammar's own parser: its verdict, once, here

    def _check_shape(self, kind: str) -> None:
        v = getattr(self, kind)
        if kind == "json":
            if isinstance(v, str):
                try:
                    parsed = json.loads(v)
                except ValueError as exc:
                    raise _bad("json", f"is not valid JSON: {exc}") from None
            else:
                parsed = v
            if not isinstance(parsed, dict):
                raise _bad("json", "must be a JSON schema (an object)")
            size = len(v) if isinstance(v, str) else len(json.dumps(v))
        elif kind in ("regex", "grammar"):
            if not isinstance(v, str) or not v:
                raise _bad(kind, "must be a non-empty string")
            size = len(v)
        elif kind == "choice":
            if not isinstance(v, (list, tuple)) or not v or len(v) > MAX_CHOICES \
                    or not all(isinstance(c, str) and c for c in v):
                raise _bad("choice", f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
            object.__setattr__(self, "choice", tuple(v))
            size = sum(len(c) for c in v)
        else:
            size = 0
        if size > MAX_SPEC_CHARS:
            raise _bad(kind, f"holds {size} characters; at most {MAX_SPEC_CHARS} are allowed")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


def _bad(name: str, need: str) -> ValueError:
    return ValueError(f"SamplingParams.structured_outputs.{name} {need}")


def _choice_ebnf(choices: tuple[str, ...]) -> str:
    # a JSON string is an EBNF literal; its characters as they are (an ASCII escape of a
    # character outside the basic plane is two surrogates, which the grammar reads as two)
    alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return f"root ::= {alts}"


# xgrammar (0.2.9) writes a length-bounded JSON string's characters as [^"\\\r\n]: raw
# control characters, which JSON forbids in a string, would be allowed; its unbounded strings
# exclude them. The same class with \0-\x1f excluded, in the grammar's own EBNF text.
_LOOSE_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\\r\n]'


def _json_strings_fixed(grammar: Any) -> Any:
    import xgrammar as xg

    text = str(grammar)
    if _LOOSE_CHARS not in text:
        return grammar
    return xg.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))


def parse_grammar(p: StructuredOutputsParams) -> Any:
    """The constraint as an ``xgrammar.Grammar`` (tokenizer-free: what a request may ask);
    ``ValueError`` naming the field with xgrammar's reason when it does not parse."""
    import xgrammar as xg

    kind = p.kind
    try:
        if kind in ("json", "json_object"):
            strict = kind == "json"
            schema = ('{"type": "object"}' if not strict else
                      p.json if isinstance(p.json, str) else json.dumps(p.json))
            return _json_strings_fixed(xg.Grammar.from_json_schema(
                schema, strict_mode=strict, any_whitespace=not p.disable_any_whitespace))
        if kind == "regex":
            return xg.Grammar.from_regex(p.regex)
        if kind == "choice":
            return xg.Grammar.from_ebnf(_choice_ebnf(p.choice))
        return xg.Grammar.from_ebnf(p.grammar)
    except (RuntimeError, ValueError, TypeError) as exc:
        what = {"json": "an invalid JSON schema", "regex": "an invalid regex",
                "grammar": "an invalid grammar (EBNF)"}.get(kind, "invalid")
        raise _bad(kind, f"is {what}: {xgrammar_reason(exc)}") from None


def as_structured(value: Any) -> StructuredOutputsParams | None:
    """``value`` (None, an instance, or its fields as a dict, as they travel) as an instance."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as exc:
            raise ValueError(f"SamplingParams.structured_outputs: {exc}") from None
    raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams, "
                     f"a dict of its fields or None, got {value!r:.60}")
