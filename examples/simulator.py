"""Colocated against disaggregated serving, with :mod:`jkernel.replay` as the simulator.

The scheduler, the KV block allocator, preemption and the clock live in the supported
replay module (``jkernel/replay/``, documented in ``docs/simulator.md``); this example only
makes a workload, opens the kernels and prints a comparison:

* ``poisson_workload(n, rate, ...)``: a seeded request table (the replay's input);
* ``kernels(bundle)``: one kernel per pool (``jkernel.open`` for a colocated deployment,
  ``jkernel.open_pool`` for each pool of a disaggregated one);
* ``run(bundle, requests)``: :func:`jkernel.replay.replay` or
  :func:`jkernel.replay.replay_disaggregated`, whichever the deployment needs;
* ``pool_table(bundle)``: what each pool's scheduler reads from its kernel.

Run ``python -m examples.simulator`` from the repository root for Llama-3.1-70B on 16 H200s,
two tp-8 colocated engines against a prefill pool of two tp-4 engines and one tp-8 decode
engine.
"""

from __future__ import annotations

import argparse
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

import jkernel
from jkernel.replay import ReplayResult, replay, replay_disaggregated
from jkernel.replay.sim import Pool

__all__ = ["COLOCATED_BUNDLE", "DISAGG_BUNDLE", "poisson_workload", "kernels", "run",
           "pool_table", "compare", "main"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
COLOCATED_BUNDLE = HERE / "llama-3.1-70b-h200-colocated.yaml"
DISAGG_BUNDLE = ROOT / "catalog" / "scenarios" / "llama-3.1-70b-h200-disagg.yaml"


def poisson_workload(n: int, rate: float, *, prompt_mean: int = 1024, output_mean: int = 256,
                     spread: float = 0.5, seed: int = 0) -> pd.DataFrame:
    """``n`` requests arriving as a Poisson process of ``rate`` requests/s (first at 0 s).

    Prompt and output lengths are uniform on ``mean · [1 − spread, 1 + spread]`` (prompts at
    least 2 tokens). The same seed always gives the same table.
    """
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=n)
    arrivals = np.cumsum(gaps) - gaps[0]

    def lengths(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - spread))), max(1, int(mean * (1 + spread)))
        return rng.integers(lo, hi + 1, size=n)

    prompts, outputs = np.maximum(lengths(prompt_mean), 2), lengths(output_mean)
    return pd.DataFrame({"request_id": np.arange(n), "arrival_s": arrivals,
                         "input_tokens": prompts, "output_tokens": outputs})


@lru_cache(maxsize=8)
def kernels(bundle=COLOCATED_BUNDLE) -> tuple[jkernel.Kernel, ...]:
    """One kernel per pool: ``(colocated,)`` or ``(prefill, decode)``."""
    roles = [p.role for p in jkernel.open_inputs(bundle).deployment.pools]
    if len(roles) == 1:
        return (jkernel.open(bundle),)
    return (jkernel.open_pool(bundle, "prefill"), jkernel.open_pool(bundle, "decode"))


def run(bundle, requests: pd.DataFrame, *, clock: str = "expected_s",
        progress: bool = False) -> ReplayResult:
    """Replay ``requests`` on the deployment of ``bundle``."""
    ks = kernels(bundle)
    if len(ks) == 1:
        return replay(ks[0], requests, clock=clock, progress=progress)
    return replay_disaggregated(*ks, requests, clock=clock, progress=progress)


def pool_table(bundle) -> pd.DataFrame:
    """What the replay's scheduler reads from each pool's kernel, one row per pool."""
    rows = []
    for k in kernels(bundle):
        pool = Pool(k)
        lim = pool.limits
        rows.append({"pool": pool.name, "engines": len(pool.engines), "tp": k.plan.tp,
                     "block_size": lim.block_size,
                     "max_num_batched_tokens": lim.max_num_batched_tokens,
                     "max_num_seqs": lim.max_num_seqs, "kv_pages": lim.pages,
                     "kv_tokens": lim.pages * lim.block_size,
                     "async_scheduling": lim.async_scheduling,
                     "prefix_caching": lim.prefix_caching,
                     "admission_2k_ms": k.admission_overhead(2048) * 1e3,
                     "output_token_us": k.output_token_overhead() * 1e6,
                     "completion_ms": k.completion_overhead() * 1e3})
    return pd.DataFrame(rows)


def compare(n: int = 2000, rate: float = 12.0, *, prompt_mean: int = 2048,
            output_mean: int = 256, seed: int = 0, clock: str = "expected_s"
            ) -> dict[str, ReplayResult]:
    """The same workload on the colocated and the disaggregated deployment."""
    reqs = poisson_workload(n, rate, prompt_mean=prompt_mean, output_mean=output_mean,
                            seed=seed)
    return {"colocated": run(COLOCATED_BUNDLE, reqs, clock=clock),
            "disaggregated": run(DISAGG_BUNDLE, reqs, clock=clock)}


def summary_table(results: dict[str, ReplayResult]) -> pd.DataFrame:
    """TTFT, ITL (ms) and E2E (s) percentiles, throughput and preemptions per deployment."""
    keys = [("completed", 1), ("ttft_p50_s", 1e3), ("ttft_p90_s", 1e3), ("itl_p50_s", 1e3),
            ("itl_p90_s", 1e3), ("e2e_p50_s", 1), ("output_tokens_per_s", 1),
            ("requests_per_s", 1), ("preemptions", 1), ("steps", 1)]
    names = {"ttft_p50_s": "ttft_p50_ms", "ttft_p90_s": "ttft_p90_ms",
             "itl_p50_s": "itl_p50_ms", "itl_p90_s": "itl_p90_ms"}
    return pd.DataFrame({label: {names.get(k, k): r.summary[k] * s for k, s in keys}
                         for label, r in results.items()})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.simulator",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=12.0, help="arrivals per second")
    ap.add_argument("--prompt", type=int, default=2048, help="mean prompt tokens")
    ap.add_argument("--output", type=int, default=256, help="mean output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=["expected_s", "no_overlap_s"], default="expected_s")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = compare(a.requests, a.rate, prompt_mean=a.prompt, output_mean=a.output,
                  seed=a.seed, clock=a.clock)
    with pd.option_context("display.float_format", "{:.2f}".format):
        print(summary_table(res))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
