"""Step-command faults for the keep-going tests: each turns a valid command into one that every
rank must reject the same way (``EpCommandFailed``), without touching the channel itself.

Invariants: a fault names only the sequences the command already carries (so exactly those
requests fail) or a slot no rank holds; it is applied once, to the next command.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from epserve.worker.ep_mirror import EpMirror
from epserve.worker.step_command import BlockUpdate, DecodeRow, SamplingUpdate, StepCommand

KINDS = ("unknown_slot", "block_out_of_range", "bad_sampling")


def _first_key(cmd: StepCommand, mirror: EpMirror) -> tuple[int, int]:
    rows = mirror.kept_rows(cmd) + [(r.rank, r.slot) for r in (*cmd.decode, *cmd.prefill)]
    if not rows:
        raise ValueError("the command carries no rows to corrupt")
    return rows[0]


def mutator(kind: str) -> Callable[[StepCommand, EpMirror], StepCommand]:
    if kind not in KINDS:
        raise ValueError(f"fault kind must be one of {', '.join(KINDS)}; got {kind!r}")

    def mutate(cmd: StepCommand, mirror: EpMirror) -> StepCommand:
        if kind == "unknown_slot":
            live = set(mirror.slots) | {(n.rank, n.slot) for n in cmd.new_seqs}
            slot = next(s for s in range(mirror.max_slots - 1, -1, -1)
                        if (mirror.world_size - 1, s) not in live)
            row = DecodeRow(mirror.world_size - 1, slot, 0, 0)
            return dataclasses.replace(cmd, decode=cmd.decode + (row,))
        rank, slot = _first_key(cmd, mirror)
        if kind == "block_out_of_range":
            have = {(b.rank, b.slot): b.first + len(b.blocks) for b in cmd.block_updates}
            first = have.get((rank, slot), mirror.num_blocks_of((rank, slot))
                             if (rank, slot) in mirror.slots else 0)
            bad = BlockUpdate(rank, slot, first, (mirror.num_blocks + 7,))
            return dataclasses.replace(cmd, block_updates=cmd.block_updates + (bad,))
        info = mirror.slots.get((rank, slot))
        base = info.sampling if info is not None else next(
            n.sampling for n in cmd.new_seqs if (n.rank, n.slot) == (rank, slot))
        upd = SamplingUpdate(rank, slot, dataclasses.replace(base, temperature=-1.0))
        if info is None:  # a new sequence: corrupt its first appearance instead
            news = tuple(dataclasses.replace(n, sampling=upd.sampling)
                         if (n.rank, n.slot) == (rank, slot) else n for n in cmd.new_seqs)
            return dataclasses.replace(cmd, new_seqs=news)
        return dataclasses.replace(cmd, sampling_updates=cmd.sampling_updates + (upd,))

    return mutate
