"""Faults in a hybrid's rewinds, for the speculative-decoding tests on one rank and under EP:
a mutation of the next step command's first rewind, and a driver that injects it until it
fires (the engine stepped by hand, so the test sees who held the sequence it hit)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


def rewinding_to(where: Callable[[int, int, int], int | None], fired: dict):
    """A fault for ``inject_fault``: a command's first rewind goes to ``where(seq_len, start,
    end)`` of its sequence's verified window (None: the command is left as it is); ``fired``
    gets the sequence's key."""
    def mutate(cmd, mirror):
        if not cmd.rewinds:
            return cmd
        r = cmd.rewinds[0]
        to = where(r.seq_len, *mirror.verified[(r.rank, r.slot)])
        if to is None:
            return cmd
        fired["key"] = (r.rank, r.slot)
        return dataclasses.replace(cmd, rewinds=(dataclasses.replace(r, seq_len=to),)
                                   + tuple(cmd.rewinds[1:]))
    return mutate


def drive(engine: Any, model: Any, prompts, sp, mutate, fired: dict) -> tuple[list, dict, dict]:
    """``prompts`` through ``engine`` step by step, ``mutate`` injected into ``model`` (the
    leader) until it fires: the request ids, who held each (rank, slot) when it fired, the
    finished outputs by id."""
    ids = [engine.add_request(f"r{i}", p, sp).request_id for i, p in enumerate(prompts)]
    owners, final = {}, {}
    while engine.has_unfinished():
        if not fired:
            owners = {(s.state.rank, s.state.slot_idx): s.request.request_id
                      for s in engine.scheduler.running if s.state is not None}
            model.inject_fault(mutate)
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert fired, "no command carried a rewind to corrupt"
    return ids, owners, final
