"""Speed of the step function: every figure as a ratio measured in this run.

    python benchmarks/bench_step.py [--quick] [--scenario llama-3.1-70b-h100-tp4]

Prints the machine, the device and the load (``os.getloadavg``) before and after, then:

  0. ``k.step_time`` at 1 and at 256 requests against the NumPy reference of the same step
     (``benchmarks/numpy_step.py``, its figures first asserted equal to 1e-12), same run
     (target ≤ 1.0 ×), and ``k.pricer()`` on the same arrays (its figure asserted equal to
     ``step_time``'s); ``--reference-only`` measures this alone;
  1. ``k.step_time(Batch(s, c))`` for a 256-request decode against the same pair for 1
     request (target ≤ 1.3 ×); also the call alone and ``step_time(scheduled=, computed=)``;
  2. building ``Batch(s, c)`` for 256 requests against the ``step_time`` call (≤ 10 %);
  3. ``k.batch_arrays(batch)`` (the gradient path), µs (≤ 20 µs);
  4. ``price_many`` on 256-request int32 arrays against a NumPy pass reading the same arrays
     once, same run (≥ 0.5), and its batches/s;
  5. one batch's gradient against its forward call (≤ 3 ×), and over 4,096 batches;
  6. ``jkernel price … --batch 32x1@4096`` as a whole process against
     ``python -c "import jax"`` (≤ 1.5 ×; the second run of the command, settings as shipped);
  7. compile of one bucket (≤ 1 s) — a fresh trace, lowering and XLA compile (where a
     bucket from 64 requests up is its request reduction alone, the program shared by
     every bucket is timed once beside it);
  8. the 256-request step with XLA's CPU client at its default thread count against one
     thread (what the entry points now choose), each in a fresh process.

Ratios are medians of interleaved rounds, so a shared machine's load affects both sides.
Runs unchanged on a GPU (``JAX_PLATFORMS`` unset): the device is printed. Also runs on an
older jkernel (features it lacks are measured the old way and marked so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import jkernel  # noqa: E402  (importing configures nothing; the first open does)
from jkernel import Batch  # noqa: E402

# the checkout whose jkernel is measured (PYTHONPATH), not necessarily this script's: the
# whole-process and thread figures run that one too
ROOT = Path(jkernel.__file__).resolve().parent.parent

NEW = hasattr(jkernel, "ArgumentError")          # a jkernel with one argument validation (ArgumentError)
if NEW:      # measure compiles honestly in this process (the CLI figure uses the cache)
    os.environ.setdefault("JKERNEL_CACHE_DIR", "0")


def per_call_us(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner * 1e6


def interleaved(fns: dict, rounds: int, inner: int, warm: bool = False) -> dict:
    """Median per-call µs of each function over ``rounds`` interleaved rounds. ``warm``:
    one untimed call before each timed block, so that no function pays for the caches the
    one before it left (the first call after another bucket's program costs a few µs more,
    which over a short block favoured whichever came second)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            if warm:
                f()
            times[k].append(per_call_us(f, inner))
    return {k: statistics.median(v) for k, v in times.items()}, times


def ratio(times: dict, a: str, b: str) -> float:
    """Median over rounds of times[a] / times[b] (same round)."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def machine(jax) -> str:
    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {platform.machine()} ({cpu}), {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, jax {jax.__version__}, "
            f"{jax.device_count()} × {dev.platform}:{getattr(dev, 'device_kind', '')}")


def load() -> str:
    return "load average " + " / ".join(f"{x:.2f}" for x in os.getloadavg())


def row(name: str, value: str, target: str = "") -> None:
    print(f"  {name:<62} {value:>18}   {target}")


def subprocess_seconds(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


_THREAD_SNIPPET = """
import json, statistics, time, numpy as np, jkernel
k = jkernel.open({scenario!r})
s1, c1 = np.ones(1, np.int32), np.full(1, 4096, np.int32)
rng = np.random.default_rng(0)
s, c = np.ones(256, np.int32), rng.integers(100, 8000, 256).astype(np.int32)
b1, b256 = jkernel.Batch(s1, c1), jkernel.Batch(s, c)
k.step_time(b1); k.step_time(b256)
def us(b, n={inner}):
    t0 = time.perf_counter()
    for _ in range(n): k.step_time(b)
    return (time.perf_counter() - t0) / n * 1e6
r = [(us(b1), us(b256)) for _ in range({rounds})]
print(json.dumps({{"one": statistics.median(a for a, _ in r),
                  "many": statistics.median(b for _, b in r)}}))
"""


def _reference():
    """The NumPy reference class (this script's folder is on ``sys.path`` when run as a
    script; as ``benchmarks.numpy_step`` from the repository root)."""
    try:
        from numpy_step import NumpyStep, Unsupported
    except ImportError:
        from benchmarks.numpy_step import NumpyStep, Unsupported
    return NumpyStep, Unsupported


def against_reference(k, rounds: int, inner: int) -> None:
    """Section 0: ``step_time`` against the NumPy reference at 1 and 256 requests (and a
    mixed batch), interleaved, after asserting both price the batches alike."""
    NumpyStep, Unsupported = _reference()
    try:
        ref = NumpyStep.of(k)
    except Unsupported as e:
        row("step_time / NumPy reference", "not measured", f"({e})")
        return
    rng = np.random.default_rng(0)
    cases = {
        "1": (np.ones(1, np.int32), np.full(1, 4096, np.int32)),
        "256": (np.ones(256, np.int32), rng.integers(100, 8000, 256).astype(np.int32)),
        "mixed64": (np.r_[np.full(1, 2048), np.ones(63)].astype(np.int32),
                    np.r_[np.zeros(1), rng.integers(100, 8000, 63)].astype(np.int32)),
    }
    fns = {}
    pricer = k.pricer(decode_threshold=1) if hasattr(k, "pricer") else None
    for name, (s, c) in cases.items():
        b = Batch(s, c)
        want, got = k.step_time(b), ref(s, c)
        for field in ("overlap_s", "no_overlap_s", "expected_s"):
            a, x = getattr(want, field), getattr(got, field)
            assert abs(a - x) <= 1e-12 * abs(a), f"{name} requests: {field} {a} != {x}"
        fns[f"jk{name}"] = lambda b=b: k.step_time(b)
        fns[f"jkpair{name}"] = lambda s=s, c=c: k.step_time(Batch(s, c))
        if NEW:
            fns[f"jkarr{name}"] = lambda s=s, c=c: k.step_time(scheduled=s, computed=c)
        if pricer is not None:
            assert pricer(s, c) == want.expected_s, f"{name} requests: the pricer differs"
            fns[f"pr{name}"] = lambda s=s, c=c: pricer(s, c)
        fns[f"np{name}"] = lambda s=s, c=c: ref(s, c)
    # many short rounds: on a shared machine the load moves within seconds, and each
    # round's ratio compares calls made within a few milliseconds of each other
    med, times = interleaved(fns, rounds * 6, max(inner // 10, 20), warm=True)
    for name, label in (("1", "1 request"), ("256", "256 decodes"),
                        ("mixed64", "1 prefill + 63 decodes")):
        target = "≤ 1.0 ×" if name != "mixed64" else ""
        row(f"step_time(batch) / NumPy reference, {label}",
            f"{ratio(times, 'jk' + name, 'np' + name):.2f} ×", target)
        row(f"   (µs: {med['jk' + name]:.1f} / {med['np' + name]:.1f}); "
            f"step_time(Batch(s, c)) {ratio(times, 'jkpair' + name, 'np' + name):.2f} ×"
            + (f", step_time(scheduled=, computed=) "
               f"{ratio(times, 'jkarr' + name, 'np' + name):.2f} ×" if NEW else ""), "")
        if pricer is not None:
            row(f"k.pricer()(s, c) / NumPy reference, {label}",
                f"{ratio(times, 'pr' + name, 'np' + name):.2f} ×", target)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="llama-3.1-70b-h100-tp4")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and batches")
    ap.add_argument("--reference-only", action="store_true",
                    help="only section 0: step_time against the NumPy reference")
    ap.add_argument("--batches", type=int, default=None,
                    help="batches for price_many (default 262,144; --quick 32,768)")
    args = ap.parse_args()
    quick = args.quick
    rounds, inner = (5, 200) if quick else (15, 500)
    nb = args.batches or (1 << 15 if quick else 1 << 18)

    k = jkernel.open(args.scenario)     # first: the entry point configures JAX's CPU backend
    import jax
    import jax.numpy as jnp

    print(f"machine   {machine(jax)}")
    print(f"jkernel   {'validating build' if NEW else 'base build'} from {jkernel.__file__}")
    print(f"scenario  {args.scenario}: {k}")
    print(f"start     {load()}")
    print(f"\n  {'figure':<62} {'measured':>18}   target")

    # 0: the step against the NumPy reference ----------------------------------------------
    against_reference(k, rounds, inner)
    if args.reference_only:
        print(f"\nend       {load()}")
        return

    rng = np.random.default_rng(0)
    s1, c1 = np.ones(1, np.int32), np.full(1, 4096, np.int32)
    s256 = np.ones(256, np.int32)
    c256 = rng.integers(100, 8000, 256).astype(np.int32)
    b1, b256 = Batch(s1, c1), Batch(s256, c256)

    # 1–2: the single step and the Batch it takes ------------------------------------------
    fns = {
        "pair1": lambda: k.step_time(Batch(s1, c1)),
        "pair256": lambda: k.step_time(Batch(s256, c256)),
        "call1": lambda: k.step_time(b1),
        "call256": lambda: k.step_time(b256),
        "batch256": lambda: Batch(s256, c256),
        "batch256_lists": (lambda sl=list(s256), cl=list(c256): Batch(sl, cl)),
    }
    if NEW:
        fns["direct256"] = lambda: k.step_time(scheduled=s256, computed=c256)
        fns["direct1"] = lambda: k.step_time(scheduled=s1, computed=c1)
    med, times = interleaved(fns, rounds, inner)
    row("step_time(Batch(s, c)) 256-decode / 1-request", f"{ratio(times, 'pair256', 'pair1'):.2f} ×",
        "≤ 1.3 ×")
    row(f"   (µs: {med['pair256']:.1f} / {med['pair1']:.1f})", "")
    row("step_time(batch) alone, 256 / 1", f"{ratio(times, 'call256', 'call1'):.2f} ×")
    if NEW:
        row("step_time(scheduled=, computed=) 256 / 1", f"{ratio(times, 'direct256', 'direct1'):.2f} ×")
        row(f"   (µs: {med['direct256']:.1f} / {med['direct1']:.1f})", "")
    row("Batch(s, c) for 256 requests (int32 arrays) / step_time call",
        f"{ratio(times, 'batch256', 'call256') * 100:.0f} %", "≤ 10 %")
    row(f"   (µs: {med['batch256']:.1f} / {med['call256']:.1f})", "")
    row("Batch(s, c) for 256 requests (Python lists) / step_time call",
        f"{ratio(times, 'batch256_lists', 'call256') * 100:.0f} %")

    # 3: batch_arrays -------------------------------------------------------------------------
    med3, _ = interleaved({"ba": lambda: jax.block_until_ready(k.batch_arrays(b256))},
                          rounds, inner // 2)
    row("k.batch_arrays(batch), 256 requests", f"{med3['ba']:.1f} µs", "≤ 20 µs")

    # 4: price_many against a NumPy pass reading the same arrays once -------------------------
    sched = np.ones((nb, 256), np.int32)
    comp = rng.integers(100, 8000, (nb, 256)).astype(np.int32)
    chunk = 1 << 13
    k.price_many(scheduled=sched[:chunk], computed=comp[:chunk], chunk=chunk)   # compile

    def against_numpy(s, c):
        """Interleaved rounds of price_many and a NumPy pass reading the same arrays once:
        (price_many seconds, NumPy seconds) per round."""
        pm, npass = [], []
        for _ in range(3 if quick else 5):
            t0 = time.perf_counter()
            k.price_many(scheduled=s, computed=c, chunk=chunk)
            pm.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.sum(axis=1)
            c.sum(axis=1)
            npass.append(time.perf_counter() - t0)
        return pm, npass

    pm, npass = against_numpy(sched, comp)
    r4 = statistics.median(n / p for n, p in zip(npass, pm))
    row(f"price_many {nb:,} × 256 int32 / NumPy read-once pass (speed)", f"{r4:.2f}", "≥ 0.5")
    row(f"   price_many {nb / statistics.median(pm):,.0f} batches/s on "
        f"{jax.devices()[0].platform}; NumPy pass {nb / statistics.median(npass):,.0f}/s", "",
        "GPU: ≥ 5e7/s (H200)")
    def aligned(a):
        buf = np.empty(a.size + 16, a.dtype)
        off = (-buf.ctypes.data % 64) // a.itemsize
        out = buf[off:off + a.size].reshape(a.shape)
        out[...] = a
        return out

    sa, ca = aligned(sched), aligned(comp)
    pa, na = against_numpy(sa, ca)
    row("   same, arrays 64-byte aligned (XLA reads them in place)",
        f"{statistics.median(n / p for n, p in zip(na, pa)):.2f}")
    # the ceiling: the compiled program alone on one device-resident chunk
    dev = [jax.device_put(x) for x in (sa[:chunk], ca[:chunk],
                                       np.tile(np.array([[1, 0, 0]], np.int32), (chunk, 1)))]
    prog = lambda: jax.block_until_ready(k._programs.many(k._flat, *dev))  # noqa: E731
    npc = lambda: (sa[:chunk].sum(axis=1), ca[:chunk].sum(axis=1))  # noqa: E731
    med4, t4 = interleaved({"prog": prog, "np": npc}, rounds, 3)
    row("   the pricing program alone (one chunk, on device) / NumPy pass",
        f"{ratio(t4, 'np', 'prog'):.2f}", "(the bound)")
    k.price_many(scheduled=sched[:chunk], computed=comp[:chunk], chunk=chunk,
                 dtype=jnp.float32)
    t0 = time.perf_counter()
    k.price_many(scheduled=sched, computed=comp, chunk=chunk, dtype=jnp.float32)
    row("   price_many float32, batches/s", f"{nb / (time.perf_counter() - t0):,.0f}")

    # 5: gradient of one batch against its forward call ---------------------------------------
    if NEW:
        grads = {"fwd": lambda: k.step_time(b256),
                 "grad": lambda: k.gradient(b256, of="no_overlap_s")}
        how = "Kernel.gradient / step_time"
        arrays = k.batch_arrays(b256)
        fwd = jax.jit(lambda p, b: k.step_fn(p, b).no_overlap_s)
        grad = jax.jit(jax.grad(lambda p, b: k.step_fn(p, b).no_overlap_s))
        _, t_old = interleaved({"fwd": lambda: fwd(k.params, arrays).block_until_ready(),
                                "grad": lambda: jax.block_until_ready(grad(k.params, arrays))},
                               rounds, inner // 5)
        row("jit(grad(step_fn)) / jit(step_fn) (a Params-shaped gradient, as before)",
            f"{ratio(t_old, 'grad', 'fwd'):.2f} ×")
    else:
        arrays = k.batch_arrays(b256)
        fwd = jax.jit(lambda p, b: k.step_fn(p, b).no_overlap_s)
        grad = jax.jit(jax.grad(lambda p, b: k.step_fn(p, b).no_overlap_s))
        grads = {"fwd": lambda: fwd(k.params, arrays).block_until_ready(),
                 "grad": lambda: jax.block_until_ready(grad(k.params, arrays))}
        how = "jit(grad(step_fn)) / jit(step_fn) (no Kernel.gradient)"
    med5, t5 = interleaved(grads, rounds, inner // 5)
    row(f"one batch's gradient / forward ({how})", f"{ratio(t5, 'grad', 'fwd'):.2f} ×",
        "≤ 3 ×")
    row(f"   (µs: {med5['grad']:.1f} / {med5['fwd']:.1f})", "")
    from jkernel.step import BatchArrays

    nbg = 4096
    s = jnp.ones((nbg, 256), jnp.int32)
    c = jnp.asarray(rng.integers(100, 8000, (nbg, 256)), jnp.int32)
    scalars = (jnp.ones(nbg, jnp.int32), jnp.zeros(nbg, jnp.int32), jnp.zeros(nbg, jnp.int32))
    # an older jkernel's BatchArrays also carried prompt_len (filled with computed)
    lanes = (s, c, c, s > 0) if "prompt_len" in BatchArrays._fields else (s, c, s > 0)
    bulk = BatchArrays(*lanes, *scalars)
    total = lambda p, b: jnp.sum(k.step_fn(p, b).no_overlap_s)  # noqa: E731
    fwd_b, grad_b = jax.jit(total), jax.jit(jax.grad(total))
    med5b, t5b = interleaved({"fwd": lambda: jax.block_until_ready(fwd_b(k.params, bulk)),
                              "grad": lambda: jax.block_until_ready(grad_b(k.params, bulk))},
                             3 if quick else 7, 3)
    row("gradient / forward summed over 4,096 batches (calibration)",
        f"{ratio(t5b, 'grad', 'fwd'):.2f} ×", "≈ 1 ×")

    # 7: compile of one bucket ------------------------------------------------------------------
    comp_s = []
    try:
        from jkernel.programs import Programs
    except ImportError:           # a jkernel before jkernel.programs: the class in kernel.py
        from jkernel.kernel import _Compiled as Programs

    split = hasattr(k._programs, "reduce_requests")   # a bucket is its request reduction alone
    for size in k.buckets[:3] if quick else k.buckets:
        packed = np.zeros(2 * size + 3, np.int32)
        fresh = Programs(k.plan, k.options, k._programs.names)      # new functions: a cold trace
        t0 = time.perf_counter()
        if split and 2 * size + 3 > 128:
            fresh.reduce_requests.lower(packed, k._flat.dtype).compile()
        else:
            fresh.one.lower(k._flat, packed).compile()
        comp_s.append((size, time.perf_counter() - t0))
    row("compile of one bucket (trace + lower + XLA), s",
        ", ".join(f"{sz}: {t:.2f}" for sz, t in comp_s), "≤ 1 s")
    if split:
        fresh = Programs(k.plan, k.options, k._programs.names)
        packed = np.zeros(2 * 64 + 3, np.int32)
        vec = fresh.reduce_requests(packed, k._flat.dtype)
        t0 = time.perf_counter()
        fresh.from_sums.lower(k._flat, vec).compile()
        row("   + once per kernel structure: the step from the sums, s",
            f"{time.perf_counter() - t0:.2f}")

    # 6: the command as a whole process against importing jax ----------------------------------
    with tempfile.TemporaryDirectory() as home:
        env = {key: v for key, v in os.environ.items() if key != "JKERNEL_CACHE_DIR"}
        env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"),
                   PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "jkernel", "price", args.scenario, "--batch", "32x1@4096"]
        first = subprocess_seconds(cmd, env)                 # the first run fills the cache
        runs = []
        for _ in range(3 if quick else 5):
            runs.append((subprocess_seconds(cmd, env),
                         subprocess_seconds([sys.executable, "-c", "import jax"], env)))
        cached = Path(home, ".cache", "jkernel", "xla")
        r6 = statistics.median(a / b for a, b in runs)
        row("`jkernel price … --batch 32x1@4096` / `python -c 'import jax'`", f"{r6:.2f} ×",
            "≤ 1.5 ×")
        row(f"   (s: first run {first:.2f}, then {statistics.median(a for a, _ in runs):.2f}"
            f" / {statistics.median(b for _, b in runs):.2f}; cache "
            f"{'on: ' + str(len(list(cached.iterdir()))) + ' entries' if cached.is_dir() else 'off'})",
            "")

        # 8: XLA CPU threads for the small step --------------------------------------------
        if jax.devices()[0].platform == "cpu":
            snippet = _THREAD_SNIPPET.format(scenario=args.scenario, inner=inner // 2,
                                             rounds=max(3, rounds // 3))
            res = {}
            for label, extra in (("default threads", {"JKERNEL_CPU_THREADS": "0"}),
                                 ("one thread", {"PJRT_NPROC": "1"})):
                e = {key: v for key, v in env.items() if key != "PJRT_NPROC"}
                e.update(extra, JKERNEL_CACHE_DIR="0" if NEW else "")
                if not NEW:
                    e.pop("JKERNEL_CACHE_DIR")
                out = subprocess.run([sys.executable, "-c", snippet], env=e, cwd=ROOT,
                                     capture_output=True, text=True, check=True)
                res[label] = json.loads(out.stdout.strip().splitlines()[-1])
            for label, r in res.items():
                row(f"256-request step_time, XLA CPU {label} (µs; / 1-request)",
                    f"{r['many']:.1f} ({r['many'] / r['one']:.2f} ×)")
    print(f"\nend       {load()}")


if __name__ == "__main__":
    main()
