"""Speed of the step function: prints the machine and the figures (medians and ratios).

    python benchmarks/bench_step.py [--scenario llama-3.1-70b-h100-tp4] [--batches 1048576]

Figures:
  * one ``step_time`` call from Python (µs, median after warm-up) for a 1-request decode, a
    256-request decode and a mixed batch;
  * ``price_many`` throughput (batches/s) on 256-request batches, float64 and float32;
  * compile time of each request bucket (s);
  * the gradient (``jax.grad`` of ``no_overlap_s`` w.r.t. every parameter) as a ratio to the
    forward call, both jitted: for one batch, and summed over 4,096 batches (calibration).
Targets (issue 3): ≤ 40 µs per 256-request call, ≥ 1e6 batches/s on 2 CPU cores,
gradient ≤ 3 × forward, compile ≤ 2 s per bucket; ≥ 5e7 batches/s on an H200.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import numpy as np

import jkernel
from jkernel import Batch


def median_us(fn, repeat: int, inner: int = 1) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times) * 1e6


def machine() -> str:
    dev = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    return (f"{platform.system()} {platform.machine()} ({cpu}), {os.cpu_count()} CPUs, "
            f"Python {platform.python_version()}, jax {jax.__version__}, device "
            f"{dev.platform}:{getattr(dev, 'device_kind', '')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="llama-3.1-70b-h100-tp4")
    ap.add_argument("--batches", type=int, default=1 << 20,
                    help="batches for the price_many throughput")
    ap.add_argument("--chunk", type=int, default=1 << 15)
    ap.add_argument("--repeat", type=int, default=2000)
    args = ap.parse_args()
    k = jkernel.open(args.scenario)     # first: jkernel's entry point configures JAX's CPU
    print(f"machine   {machine()}")    # backend (synchronous dispatch) before it starts
    print(f"scenario  {args.scenario}: {k}")

    print("\ncompile time per bucket (first call of a fresh program)")
    for size in k.buckets:
        t0 = time.perf_counter()
        k.step_time(Batch([1] * min(size, 8), [100] * min(size, 8)) if size == k.buckets[0]
                    else Batch([1] * size, [100] * size))
        print(f"  bucket {size:>5}: {time.perf_counter() - t0:6.2f} s")

    rng = np.random.default_rng(0)
    batches = {
        "1-request decode": Batch([1], [4096]),
        "256-request decode": Batch([1] * 256, rng.integers(100, 8000, 256)),
        "mixed (1 prefill of 2048 + 63 decodes)": Batch([2048] + [1] * 63,
                                                        [0] + list(rng.integers(100, 8000, 63))),
    }
    print("\nstep_time from Python, median per call")
    for name, b in batches.items():
        k.step_time(b)
        us = median_us(lambda: k.step_time(b), repeat=args.repeat)
        print(f"  {name:<40} {us:8.1f} µs")

    print("\nprice_many on 256-request batches (one program per chunk of batches)")
    n = args.batches
    sched = np.ones((n, 256), np.int32)
    comp = rng.integers(100, 8000, (n, 256)).astype(np.int32)
    for dtype, label in ((None, "float64"), (np.float32, "float32")):
        k.price_many(scheduled=sched[:args.chunk], computed=comp[:args.chunk], chunk=args.chunk,
                     dtype=dtype)                                    # compile
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            k.price_many(scheduled=sched, computed=comp, chunk=args.chunk, dtype=dtype)
            runs.append(time.perf_counter() - t0)
        rate = n / statistics.median(runs)
        print(f"  {label}: {n:,} batches in {statistics.median(runs):.3f} s → "
              f"{rate:,.0f} batches/s")

    print("\ngradient of one batch (256-request decode) against the forward call, both jitted")
    arrays = k.batch_arrays(batches["256-request decode"])
    fwd = jax.jit(lambda p, b: k.step_fn(p, b).no_overlap_s)
    grad = jax.jit(jax.grad(lambda p, b: k.step_fn(p, b).no_overlap_s))
    fwd(k.params, arrays).block_until_ready()
    jax.block_until_ready(grad(k.params, arrays))
    t_f = median_us(lambda: fwd(k.params, arrays).block_until_ready(), repeat=500)
    t_g = median_us(lambda: jax.block_until_ready(grad(k.params, arrays)), repeat=500)
    print(f"  forward {t_f:8.1f} µs   gradient {t_g:8.1f} µs   ratio {t_g / t_f:5.2f}")

    print("\ngradient over 4,096 batches at once (the calibration case), both jitted")
    import jax.numpy as jnp
    from jkernel.step import BatchArrays

    nb = 4096
    s = jnp.ones((nb, 256), jnp.int32)
    c = jnp.asarray(rng.integers(100, 8000, (nb, 256)), jnp.int32)
    bulk = BatchArrays(s, c, s > 0, jnp.ones(nb, jnp.int32), jnp.zeros(nb, jnp.int32),
                       jnp.zeros(nb, jnp.int32))
    total = lambda p, b: jnp.sum(k.step_fn(p, b).no_overlap_s)  # noqa: E731
    fwd_b, grad_b = jax.jit(total), jax.jit(jax.grad(total))
    jax.block_until_ready(fwd_b(k.params, bulk))
    jax.block_until_ready(grad_b(k.params, bulk))
    t_f = median_us(lambda: jax.block_until_ready(fwd_b(k.params, bulk)), repeat=50)
    t_g = median_us(lambda: jax.block_until_ready(grad_b(k.params, bulk)), repeat=50)
    print(f"  forward {t_f / 1e3:8.2f} ms   gradient {t_g / 1e3:8.2f} ms   ratio {t_g / t_f:5.2f}")


if __name__ == "__main__":
    main()
