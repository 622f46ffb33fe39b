"""AppConfig: what ``build_app`` takes (from ``serve.yaml`` args, the CLI, or Python).

Invariants: engine options are exactly ``EngineArgs``'s fields and server options this class's
own; an unknown key or a bad value raises ``ValueError`` naming it before anything starts; an
API key (given or from ``$EPSERVE_API_KEY``) is used stripped of surrounding whitespace, and
one that is empty after stripping is refused, never taken as "no auth"; the config crosses to
the ingress replica as a plain dict.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from epserve.cluster.bringup import HEAD_NAME
from epserve.cluster.engine_args import EngineArgs
from epserve.deploy.chat_output import ChatParsing

#: The name the built-in demo model is served under when no --served-model-name is given.
DEMO_SERVED_NAME = "epserve-demo"
API_KEY_ENV = "EPSERVE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: Seconds a request's whole body may take to arrive once its handler starts (then a 408).
DEFAULT_BODY_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class AppConfig:
    """Server options beside the engine's. ``api_key`` None: ``$EPSERVE_API_KEY`` in the
    ingress process, and no auth when that is unset too."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    head_name: str = HEAD_NAME
    num_replicas: int = 1
    max_ongoing_requests: int = 1024
    # the chat output's parsers, as vLLM's serve flags of the same names (the reasoning
    # parser is the engine's option: EngineArgs.reasoning_parser)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # vLLM's --return-tokens-as-token-ids: logprob token strings as "token_id:N" by default
    return_tokens_as_token_ids: bool = False

    def __post_init__(self) -> None:
        for name in ("enable_auto_tool_choice", "return_tokens_as_token_ids"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self.chat_parsing()  # an unknown parser, or auto tool choice without one: refused
        for name in ("max_body_bytes", "num_replicas", "max_ongoing_requests"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        t = self.body_read_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (
                math.isfinite(t) and t > 0):
            raise ValueError(f"body_read_timeout_s must be a positive number of seconds, "
                             f"got {t!r}")
        if self.api_key is not None:
            if not isinstance(self.api_key, str):
                raise ValueError("api_key must be a string or None")
            # frozen: the stripped key replaces the given one (an env file's trailing newline
            # would otherwise make a key no client can send)
            object.__setattr__(self, "api_key", _stripped_key(self.api_key, "api_key"))
        if not isinstance(self.head_name, str) or not self.head_name:
            raise ValueError(f"head_name must be a non-empty string, got {self.head_name!r}")

    @property
    def served_model_name(self) -> str:
        e = self.engine
        return e.served_model_name or e.model or DEMO_SERVED_NAME

    def resolved_api_key(self) -> str | None:
        """The key to require: ``api_key``, else ``$EPSERVE_API_KEY`` when set (stripped;
        set but blank is an error), else None (no auth)."""
        if self.api_key is not None:
            return self.api_key
        env = os.environ.get(API_KEY_ENV)
        return None if env is None else _stripped_key(env, API_KEY_ENV)

    def chat_parsing(self) -> ChatParsing:
        """The tool-call and reasoning parsers of the chat output."""
        return ChatParsing(self.enable_auto_tool_choice, self.tool_call_parser,
                           self.engine.reasoning_parser)

    def engine_args(self) -> EngineArgs:
        """The engine's args with the served name filled in (the head reports it)."""
        return dataclasses.replace(self.engine, served_model_name=self.served_model_name)

    def to_dict(self) -> dict[str, Any]:
        """Flat, as serve.yaml's ``args`` write it."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "engine"}
        return {**self.engine.to_dict(), **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "AppConfig":
        d = dict(d or {})
        own = {f.name for f in dataclasses.fields(cls)} - {"engine"}
        mine = {k: d.pop(k) for k in list(d) if k in own}
        return cls(engine=EngineArgs.from_dict(d), **mine)


def _stripped_key(key: str, source: str) -> str:
    stripped = key.strip()
    if not stripped:
        raise ValueError(f"{source} is empty or only whitespace; give a key, or leave it unset "
                         f"for a server without auth")
    return stripped
