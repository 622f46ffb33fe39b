"""Run ``bench/throughput.py`` with other fused-MoE tiles for one launch class; prints its table.

``bench/moe_tiles.py`` times one MoE layer; this answers whether a faster layer makes the
workload faster, without editing the kernel's defaults. The tiles given replace
``default_tiles`` wherever it would return what it returns for ``--pairs`` (token, expert)
pairs at the Qwen3-30B-A3B layer shape (default 256 x 8: the short workload's decode step),
i.e. for the whole launch class that pair count falls in; every other class keeps its tiles.

    python bench/tiles_workload.py --tiles "m32|n128 k128 w8 s3|n128 k128 w4 s3" \
        -- --workload short --skip-transformers --repeats 3
    python bench/tiles_workload.py --best-of moe_tiles.log -- --workload short ...

``--best-of LOG`` takes the fastest candidate of the ``T=<pairs / 8>`` lines a
``moe_tiles.py --tiles`` run printed, and exits 3 without running the workload when none beat
the defaults by ``--margin`` (default 3%).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import epserve.kernels.triton.fused_moe as fused_moe  # noqa: E402
from moe_tiles import E, H, I, K, parse_tiles  # noqa: E402


def best_of(log: str, tokens: int, margin: float):
    """(tiles, ms, default ms) of the fastest candidate at ``tokens`` in a moe_tiles log, or
    None when none beats the default by ``margin``."""
    text = Path(log).read_text()
    d = re.search(rf"^T={tokens}: default ([\d.]+) ms", text, re.M)
    if d is None:
        raise SystemExit(f"tiles_workload: {log} has no 'T={tokens}: default' line")
    cands = [(float(ms), spec) for spec, ms in
             re.findall(rf"^T={tokens} (m\d+\s*\|[^:]+): ([\d.]+) ms$", text, re.M)]
    if not cands:
        raise SystemExit(f"tiles_workload: {log} times no candidate at T={tokens}")
    ms, spec = min(cands)
    base = float(d.group(1))
    return (parse_tiles(spec), ms, base) if ms < base * (1 - margin) else None


def main(argv: list[str]) -> int:
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else \
        (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pick = ap.add_mutually_exclusive_group(required=True)
    pick.add_argument("--tiles", type=parse_tiles, help="m | n k w s | n k w s")
    pick.add_argument("--best-of", metavar="LOG", help="a moe_tiles.py --tiles log")
    ap.add_argument("--pairs", type=int, default=256 * K, help="a pair count of the class")
    ap.add_argument("--margin", type=float, default=0.03)
    args = ap.parse_args(ours)
    tiles = args.tiles
    if args.best_of:
        found = best_of(args.best_of, args.pairs // K, args.margin)
        if found is None:
            print(f"tiles_workload: no candidate in {args.best_of} beats the defaults by "
                  f"{args.margin:.0%}; workload not run")
            return 3
        tiles, ms, base = found
        print(f"tiles_workload: {tiles.describe()} {ms:.4f} ms against the defaults' {base:.4f}")
    orig = fused_moe.default_tiles
    ref = orig(args.pairs, E, H, I)

    def patched(num_pairs, num_local, h, inter, elem_bytes=2):
        got = orig(num_pairs, num_local, h, inter, elem_bytes)
        return tiles if got == ref else got

    fused_moe.default_tiles = patched  # read at call time by launch_class
    print(f"tiles_workload: launch class of {args.pairs} pairs ({ref.describe()}) -> "
          f"{tiles.describe()}", flush=True)
    import throughput
    return throughput.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
