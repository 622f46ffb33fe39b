"""bench/throughput.py runs end to end on CPU (tiny config, epserve only) and prints its
markdown table last, with an epserve row per workload and a positive output tok/s."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "throughput.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_throughput", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_tiny_cpu_run_prints_epserve_rows(capsys):
    bench = _load()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads only contend on a busy 2-core VM
    try:
        rc = bench.main(["--tiny", "--device", "cpu", "--skip-transformers", "--workload",
                         "short", "long", "--requests", "3", "--in-len", "8", "--out-len", "4"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| workload |"))
    rows = [ln for ln in lines[header + 2:] if ln.startswith("|")]
    assert len(rows) == 2 and lines[-1] == rows[-1]  # the table is printed last
    for workload, row in zip(("short", "long"), rows):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == f"{workload} (3 x 8->4)"
        assert cells[1] == "epserve"
        assert float(cells[2]) > 0 and float(cells[3]) > 0  # wall s, out tok/s
        assert float(cells[4]) > 0  # mean step ms
    assert "KV blocks=" in out and "max_num_seqs=256" in out


def test_floor_uses_the_experts_a_batch_touches():
    bench = _load()
    cfg = bench.QWEN3_30B_A3B
    one = bench.floor_s(cfg, 1, 1, 1000.0)
    assert abs(one - bench.active_bytes(cfg) / 1e12) < 1e-12  # batch 1: decode_latency's bytes
    assert bench.floor_s(cfg, 256, 1, 1000.0) > 5 * one  # batch 256 reads ~all 128 experts
