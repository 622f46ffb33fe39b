"""AppConfig: what ``build_app`` takes (from ``serve.yaml`` args, the CLI, or Python).

Invariants: engine options are exactly ``EngineArgs``'s fields and server options this class's
own; an unknown key or a bad value raises ``ValueError`` naming it before anything starts; the
config crosses to the ingress replica as a plain dict.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from epserve.cluster.bringup import HEAD_NAME
from epserve.cluster.engine_args import EngineArgs

#: The name the built-in demo model is served under when no --served-model-name is given.
DEMO_SERVED_NAME = "epserve-demo"
API_KEY_ENV = "EPSERVE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 1 << 20


@dataclass(frozen=True)
class AppConfig:
    """Server options beside the engine's. ``api_key`` None: ``$EPSERVE_API_KEY`` in the
    ingress process, and no auth when that is unset too."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    head_name: str = HEAD_NAME
    num_replicas: int = 1
    max_ongoing_requests: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "num_replicas", "max_ongoing_requests"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if not isinstance(self.head_name, str) or not self.head_name:
            raise ValueError(f"head_name must be a non-empty string, got {self.head_name!r}")

    @property
    def served_model_name(self) -> str:
        e = self.engine
        return e.served_model_name or e.model or DEMO_SERVED_NAME

    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get(API_KEY_ENV) or None

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
