"""Where a process's threads spend their time, from ``py-spy record --threads -f raw`` (one
line per distinct stack: ``thread (tid): name;frame;...;frame count``). Without ``--idle``
py-spy drops the samples it judges idle (a thread in a blocking call); its judgement is a
heuristic (in a container a ``Condition.wait`` can still count), so read the frames: a CUDA
synchronisation that spins counts as running.

Per thread: its on-CPU samples, the frames with the most samples below them (cumulative) and
the innermost frames (self), so one sees what each thread does. Used on the serving head
(issue 19: the time between the engine's steps):

    py-spy record --pid $(pgrep -f ray::HeadActor) --threads -r 200 -d 8 -f raw -o head.raw
    python bench/pyspy_summary.py head.raw --top 25
"""

from __future__ import annotations

import argparse
import collections


def summarize(path: str, top: int) -> str:
    samples: collections.Counter = collections.Counter()
    inner: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    below: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(path, encoding="utf-8"):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        thread, *frames = stack.split(";")
        samples[thread] += int(n)
        inner[thread][frames[-1] if frames else "<no Python frame>"] += int(n)
        for frame in set(frames):
            below[thread][frame] += int(n)
    out = []
    for thread, n in samples.most_common():
        out.append(f"{thread}: {n} samples")
        out += [f"  cum  {m:6d} {f[:140]}" for f, m in below[thread].most_common(top)]
        out += [f"  self {m:6d} {f[:140]}" for f, m in inner[thread].most_common(top // 2)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw", help="py-spy record --threads -f raw output")
    ap.add_argument("--top", type=int, default=20, help="frames listed per thread")
    args = ap.parse_args()
    print(summarize(args.raw, args.top))


if __name__ == "__main__":
    main()
