#!/usr/bin/env bash
# Bulk pricing (price_many) and replay figures on an accelerator, in under 5 minutes.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# Needs only what `pip install '.[test]'` and `pip install 'jax[cuda12]'` give; installs
# nothing. Measures the checkout it is run from (its root goes first on PYTHONPATH). Prints:
#   1. the machine: GPUs (nvidia-smi), CPUs, load, jax and its devices;
#   2. price_many on 256-request int32 batches (llama-3.1-70b-h100-tp4): batches/s at two
#      chunk sizes, float64 and float32, against a NumPy pass reading the same arrays once
#      (ratio, same run), the pricing program alone on device-resident chunks, and the
#      largest relative difference from the CPU's prices on a sample (prices unchanged);
#   3. the replay of the 8 requests/s residency run (its synthetic twin without the shared
#      data) on the accelerator, then on the CPU of the same machine (JAX_PLATFORMS=cpu).
# Environment: GPU_CHECK_BATCHES (default 1048576), GPU_CHECK_TRACE (a trace.csv).
# Each part has its own time limit; a part that runs out prints so and the script goes on.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export JKERNEL_CACHE_DIR="${JKERNEL_CACHE_DIR:-0}"      # compile honestly, write nothing
BATCHES="${GPU_CHECK_BATCHES:-1048576}"
TRACE="${GPU_CHECK_TRACE:-}"
if [ -z "$TRACE" ]; then
  for t in "$ROOT/shared/data/residency-vllm/sweep_rate/agg_8rps/patched/trace.csv" \
           "$ROOT/../shared/data/residency-vllm/sweep_rate/agg_8rps/patched/trace.csv"; do
    [ -f "$t" ] && TRACE=$t && break
  done
fi
START=$(date +%s)

part() {   # part SECONDS TITLE COMMAND...
  local limit=$1 title=$2; shift 2
  echo; echo "== $title (limit ${limit} s)"
  local t0; t0=$(date +%s)
  timeout "$limit" "$@"
  local rc=$?
  [ $rc -eq 124 ] && echo "   (stopped at the ${limit} s limit)"
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && echo "   (failed: exit $rc)"
  echo "   ($(( $(date +%s) - t0 )) s)"
}

echo "== machine"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
else
  echo "nvidia-smi: not found"
fi
echo "$(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg); $(python --version 2>&1)"
python -c "import jax; print('jax', jax.__version__, jax.devices())"

part 150 "price_many, 256-request batches, ${BATCHES} batches" python - "$BATCHES" <<'EOF'
import statistics
import sys
import time

import numpy as np
import jax
import jkernel

nb = int(sys.argv[1])
k = jkernel.open("llama-3.1-70b-h100-tp4")
dev = jax.devices()[0]
print(f"   device {dev.platform}:{getattr(dev, 'device_kind', '')} × {jax.device_count()}")
rng = np.random.default_rng(0)
sched = np.ones((nb, 256), np.int32)
comp = rng.integers(100, 8000, (nb, 256)).astype(np.int32)
sched[::7, 0] = rng.integers(2, 4096, len(sched[::7]))          # some prefills

# prices unchanged: a sample priced here and on the CPU
sample = slice(0, min(nb, 2048))
here = k.price_many(scheduled=sched[sample], computed=comp[sample])
with jax.default_device(jax.devices("cpu")[0]):
    cpu = k.price_many(scheduled=sched[sample], computed=comp[sample])
worst = max(float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300)))
            for a, b in ((here.expected_s, cpu.expected_s), (here.no_overlap_s, cpu.no_overlap_s),
                         (here.overlap_s, cpu.overlap_s)))
print(f"   largest relative difference from the CPU on {sample.stop} batches: {worst:.2e}")

def rounds(fn, n=3):
    fn()                                                        # compile / warm
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        pm = time.perf_counter() - t0
        t0 = time.perf_counter()
        sched.sum(axis=1)
        comp.sum(axis=1)
        out.append((pm, time.perf_counter() - t0))
    return out

import jax.numpy as jnp
for chunk in (1 << 16, 1 << 18):
    for dtype in (None, jnp.float32):
        r = rounds(lambda: k.price_many(scheduled=sched, computed=comp, chunk=chunk,
                                        dtype=dtype))
        pm = statistics.median(a for a, _ in r)
        speed = statistics.median(b / a for a, b in r)
        print(f"   chunk {chunk:>7,} {'float32' if dtype else 'float64'}: {nb / pm:>14,.0f} "
              f"batches/s; NumPy read-once pass / price_many {speed:.2f} (target ≥ 0.5; "
              f"H200 target ≥ 5e7/s)")
# the ceiling: the program alone on one device-resident chunk
chunk = min(nb, 1 << 18)
args = [jax.device_put(x) for x in (sched[:chunk], comp[:chunk],
                                    np.tile(np.array([[1, 0, 0]], np.int32), (chunk, 1)))]
prog = lambda: jax.block_until_ready(k._c.many(k._flat, *args))  # noqa: E731
prog()
times = []
for _ in range(5):
    t0 = time.perf_counter()
    prog()
    times.append(time.perf_counter() - t0)
print(f"   the pricing program alone, one chunk of {chunk:,} on device: "
      f"{chunk / statistics.median(times):,.0f} batches/s")
EOF

part 75 "replay on the accelerator" python benchmarks/bench_replay.py ${TRACE:+--trace "$TRACE"}
part 60 "replay on the CPU of the same machine (JAX_PLATFORMS=cpu)" env JAX_PLATFORMS=cpu \
  python benchmarks/bench_replay.py ${TRACE:+--trace "$TRACE"}
echo; echo "== done in $(( $(date +%s) - START )) s; load average $(cut -d' ' -f1-3 /proc/loadavg)"
