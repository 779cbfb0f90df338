"""Property tests (hypothesis) on random valid batches of catalog deployments.

For every drawn batch: finite and non-negative, Overlap ≤ NoOverlap, NoOverlap is the sum of
the resources, the bottleneck is the largest resource (ties keep the earlier), the vmapped
``price_many`` equals the per-batch calls, float32 agrees with float64 to 1e-5, and the price
does not decrease when a request's cached context or a prefill's scheduled tokens grow.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import jkernel
from jkernel import Batch
from conftest import catalog_kernel

# (scenario, pool): a dense, an MoE, an MLA+MoE, a sliding-window MoE, an EP+DP MoE and a
# disaggregated decode pool.
DEPLOYMENTS = [("llama-3.1-70b-h100-tp4", None), ("mixtral-8x7b-h100-tp2", None),
               ("deepseek-v3-h200-fp8-tp8", None), ("gpt-oss-120b-b200-tp8", None),
               ("qwen3-30b-a3b-h200-ep", None), ("llama-3.1-70b-h200-disagg", "decode")]

PROPS = settings(max_examples=25, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def batches(draw, max_requests=14):
    n = draw(st.integers(0, max_requests))
    thr = draw(st.sampled_from([1, 8]))
    sched, comp = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "decode", "prefill", "pad"]))
        if kind == "decode":
            sched.append(draw(st.integers(1, thr)))
        elif kind == "prefill":
            sched.append(draw(st.integers(thr + 1, 3000)))
        else:
            sched.append(0)                            # D32: a zero request is padding
        comp.append(draw(st.integers(0, 60000)))
    pad = draw(st.sampled_from([0, 0, 0, 3, 40]))
    return Batch(sched, comp, decode_threshold=thr, pad_tokens=pad)


def kernel(i: int) -> jkernel.Kernel:
    name, pool = DEPLOYMENTS[i]
    try:
        return catalog_kernel(name, pool)
    except (jkernel.Refusal, FileNotFoundError) as exc:   # pragma: no cover
        pytest.fail(f"catalog scenario {name} does not open: {exc}")


def check_one(est: jkernel.StepEstimate) -> None:
    per = est.per_resource_s
    vals = np.array([per[r] for r in jkernel.RESOURCES])
    assert np.all(np.isfinite(vals)) and np.all(vals >= 0)
    assert np.isfinite(est.expected_s) and est.expected_s >= 0
    assert 0 <= est.overlap_s <= est.no_overlap_s * (1 + 1e-12)
    assert est.no_overlap_s == pytest.approx(vals.sum(), rel=1e-12)
    assert est.bottleneck == int(np.argmax(vals))        # argmax keeps the first of ties


@PROPS
@given(st.integers(0, len(DEPLOYMENTS) - 1), st.lists(batches(), min_size=1, max_size=4))
def test_step_properties_and_bulk_agreement(i, drawn):
    k = kernel(i)
    singles = [k.step_time(b) for b in drawn]
    for est in singles:
        check_one(est)
    bulk = k.price_many(drawn)
    bulk32 = k.price_many(drawn, dtype=np.float32)
    for j, est in enumerate(singles):
        for field in ("overlap_s", "no_overlap_s", "expected_s"):
            assert getattr(bulk, field)[j] == pytest.approx(getattr(est, field), rel=1e-12)
            assert getattr(bulk32, field)[j] == pytest.approx(getattr(est, field), rel=1e-5)
        assert bulk.bottleneck[j] == est.bottleneck


@PROPS
@given(st.integers(0, len(DEPLOYMENTS) - 1), batches(), st.data())
def test_monotone_in_context(i, batch, data):
    """Growing one request's cached tokens never lowers any estimate."""
    assume(len(batch) > 0)
    k = kernel(i)
    j = data.draw(st.integers(0, len(batch) - 1))
    grow = data.draw(st.integers(1, 20000))
    comp = batch.computed.copy()
    comp[j] += grow
    more = Batch(batch.scheduled, comp, decode_threshold=batch.decode_threshold,
                 pad_tokens=batch.pad_tokens)
    a, b = k.step_time(batch), k.step_time(more)
    for field in ("overlap_s", "no_overlap_s", "expected_s"):
        assert getattr(b, field) >= getattr(a, field) * (1 - 1e-12)


@PROPS
@given(st.integers(0, len(DEPLOYMENTS) - 1), batches(), st.data())
def test_monotone_in_prefill_tokens(i, batch, data):
    """Growing a prefill's scheduled tokens never lowers the price, as long as the step stays
    on the same side of the CUDA-graph capture ceiling (crossing it switches to eager launch,
    which the spec prices per layer instead of per segment: a deliberate discontinuity)."""
    k = kernel(i)
    prefills = [j for j in range(len(batch)) if batch.scheduled[j] > batch.decode_threshold]
    assume(prefills)
    j = data.draw(st.sampled_from(prefills))
    sched = batch.scheduled.copy()
    sched[j] += data.draw(st.integers(1, 2000))
    more = Batch(sched, batch.computed, decode_threshold=batch.decode_threshold,
                 pad_tokens=batch.pad_tokens)
    ceiling = k.plan.capture_ceiling
    assume((batch.tokens() + batch.pad_tokens > ceiling)
           == (more.tokens() + more.pad_tokens > ceiling))
    a, b = k.step_time(batch), k.step_time(more)
    for field in ("overlap_s", "no_overlap_s", "expected_s"):
        assert getattr(b, field) >= getattr(a, field) * (1 - 1e-12)
