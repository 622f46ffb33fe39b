"""bench/serve.py runs against the session's live server (streamed and not) and prints its
markdown table last: every request answered, each with exactly the tokens asked for."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_bench_serve_against_the_live_server(server, capsys):
    bench = _load()
    rc = bench.main(["--url", server.base, "--api-key", server.api_key, "--num-prompts", "4",
                     "--input-len", "8", "--output-len", "4", "--max-concurrency", "2",
                     "--mode", "stream", "nonstream", "--skip-offline",
                     "--warmup-requests", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("| mode |"))
    names = [c.strip() for c in lines[header].strip("|").split("|")]
    rows = [dict(zip(names, (c.strip() for c in ln.strip("|").split("|"))))
            for ln in lines[header + 2:]]
    assert lines[-1].startswith("|") and len(rows) == 2  # the table is printed last
    assert [r["mode"] for r in rows] == ["stream", "nonstream"]
    for r in rows:
        assert r["load"] == "c=2"
        assert r["errors"] == "0" and r["mismatches"] == "0", out
        assert float(r["out tok/s"]) > 0 and float(r["req/s"]) > 0
    stream = rows[0]
    assert float(stream["TTFT p50 ms"]) > 0 and float(stream["tokens/chunk"]) >= 1
    assert "4 prompts x 8 -> 4 tokens" in out
