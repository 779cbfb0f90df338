"""The benchmarks' NumPy reference (``benchmarks/numpy_step.py``, written from the spec, not
from jkernel's code) prices every batch as ``Kernel.step_time`` does, to 1e-12 relative:
so the speed comparison in ``benchmarks/bench_step.py`` compares two implementations of
the same figures. Random decodes, prefills, mixed batches, decode-threshold crossings,
zero-padding rows, pad tokens, SM budgets, the capture ceiling, 1 to 256 requests and the
empty step, on the three dense deployments the benchmarks price."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.numpy_step import RESOURCES, NumpyStep, Unsupported
from conftest import catalog_kernel

SCENARIOS = ["qwen3-14b-h100-tp1", "llama-3.1-70b-h100-tp4", "llama-3.1-8b-h100-tp1"]
REL = 1e-12


def batches(seed: int, count: int):
    """``count`` random ``(scheduled, computed, decode_threshold, sm_budget, pad_tokens)``
    of every shape the step walk distinguishes."""
    rng = np.random.default_rng(seed)
    shapes = ["decode", "prefill", "mixed", "threshold", "padding", "pad", "budget",
              "eager", "single"]
    out = [(np.zeros(0, np.int32), np.zeros(0, np.int32), 1, 0, 0),     # the empty step
           (np.zeros(3, np.int32), np.full(3, 50, np.int32), 1, 0, 0),  # only padding rows
           (np.zeros(0, np.int32), np.zeros(0, np.int32), 1, 0, 37),    # a DP rank's pad
           (np.ones(256, np.int32), np.full(256, 4096, np.int32), 1, 0, 0),
           (np.array([1], np.int32), np.array([0], np.int32), 1, 0, 0)]
    for i in range(count - len(out)):
        shape = shapes[i % len(shapes)]
        n = int(rng.integers(1, 257))
        thr, budget, pad = 1, 0, 0
        s = np.ones(n, np.int32)
        c = rng.integers(0, 32768, n).astype(np.int32)
        if shape == "prefill":
            n = int(rng.integers(1, 9))
            s = rng.integers(2, 4097, n).astype(np.int32)
            c = rng.integers(0, 8193, n).astype(np.int32)
        elif shape == "mixed":
            k = int(rng.integers(1, min(n, 8) + 1))
            s[:k] = rng.integers(2, 2049, k)
            rng.shuffle(s)
        elif shape == "threshold":                         # around the decode threshold
            thr = int(rng.integers(1, 9))
            s = rng.integers(max(thr - 1, 1), thr + 3, n).astype(np.int32)
        elif shape == "padding":                           # D32: scheduled 0 is padding
            s[rng.random(n) < 0.3] = 0
            s[: max(1, n // 10)] = rng.integers(0, 300, max(1, n // 10))
        elif shape == "pad":
            pad = int(rng.integers(-5, 600))
        elif shape == "budget":
            budget = int(rng.integers(0, 200))
            s[0] = int(rng.integers(1, 3000))
        elif shape == "eager":                             # past the capture ceiling
            s = rng.integers(2, 64, n).astype(np.int32)
            c = rng.integers(0, 2048, n).astype(np.int32)
        elif shape == "single":
            n = 1
            s = rng.integers(1, 3, 1).astype(np.int32)
            c = rng.integers(0, 100_000, 1).astype(np.int32)
        out.append((s, c, thr, budget, pad))
    return out


def close(a: float, b: float) -> bool:
    if a == b:                                             # zeros and infinities
        return True
    return abs(a - b) <= REL * max(abs(a), abs(b))


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_numpy_reference_prices_as_step_time(scenario):
    k = catalog_kernel(scenario)
    ref = NumpyStep.of(k)
    seen = set()
    for j, (s, c, thr, budget, pad) in enumerate(batches(SCENARIOS.index(scenario), 150)):
        got = ref(s, c, decode_threshold=thr, sm_budget=budget, pad_tokens=pad)
        want = k.step_time(scheduled=s, computed=c, decode_threshold=thr, sm_budget=budget,
                           pad_tokens=pad)
        what = f"{scenario} batch {j}: n={s.size}, thr={thr}, budget={budget}, pad={pad}"
        for field in ("overlap_s", "no_overlap_s", "expected_s"):
            assert close(getattr(got, field), getattr(want, field)), \
                f"{what}: {field} {getattr(got, field)!r} != {getattr(want, field)!r}"
        for r in RESOURCES:
            assert close(got.per_resource_s[r], float(want.per_resource_s[r])), \
                f"{what}: {r} {got.per_resource_s[r]!r} != {want.per_resource_s[r]!r}"
        assert got.bottleneck == want.bottleneck, what
        seen.add(want.bottleneck)
    assert len(seen) >= 2                   # the batches move the bottleneck


def test_the_worked_step_of_the_readme():
    """``llama-3.1-70b-h100-tp4``, 32 decodes at 4,096 cached tokens: the README's figures."""
    ref = NumpyStep.of(catalog_kernel("llama-3.1-70b-h100-tp4"))
    est = ref(np.ones(32, np.int32), np.full(32, 4096, np.int32))
    assert est.no_overlap_s == pytest.approx(23.641e-3, abs=1e-6)
    assert est.overlap_s == pytest.approx(19.441e-3, abs=1e-6)
    assert est.expected_s == pytest.approx(21.095e-3, abs=1e-6)
    assert est.per_resource_s["nvlink"] == pytest.approx(2.121e-3, abs=1e-6)
    assert est.bottleneck == RESOURCES.index("hbm")


def test_a_plan_outside_its_scope_is_refused_by_name():
    with pytest.raises(Unsupported, match="experts"):
        NumpyStep.of(catalog_kernel("mixtral-8x7b-h100-tp2"))
