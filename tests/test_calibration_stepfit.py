"""Fitting the engine-level step constants (jkernel.calibration.fit.stepfit) on synthetic steps with
known values, and the step's unhidden host term they feed (jkernel.terms.host_serial)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jkernel
from jkernel.calibration.fit import steperrors as V
from jkernel.calibration.fit import stepfit as S
from jkernel.calibration.fit import traces as T

SCENARIO = "qwen3-14b-h100-tp1"
TRUTH = {"host_serial": 700e-6, "host_serial_per_request": 25e-6, "compute_derate": 0.92}
#: The engine-level constants as profiles leave them (what the fit starts from).
START = {"host_serial": 0.0, "host_serial_per_request": 0.0, "compute_derate": 1.0,
         "kernel_gap": 0.0}


#: Stated recovery tolerances (relative) for the design of serving_batches: the per-request
#: cost rests on 1–12 requests' spread (its standard error is about 9 % here).
TOLERANCE = {"host_serial": 0.05, "host_serial_per_request": 0.2, "compute_derate": 0.02}


@pytest.fixture(scope="module")
def kernel():
    k = jkernel.open(SCENARIO)
    return k.with_params(k.params.replace(**START))


def serving_batches(rng, n):
    """Steps shaped like a 2 req/s serving run: 1–12 decodes near 1k context, a tenth of
    them with one 1k-token prefill."""
    out = []
    for i in range(n):
        d = int(rng.integers(1, 13))
        s = [1] * d
        c = [int(x) for x in rng.integers(990, 1120, d)]
        if i % 10 == 0:
            s.append(int(rng.integers(950, 1050)))
            c.append(0)
        out.append(jkernel.Batch(s, c))
    return out


@pytest.fixture(scope="module")
def synthetic(kernel):
    rng = np.random.default_rng(3)
    truth = kernel.params.replace(**TRUTH)
    tr = T.generate_trace(kernel, serving_batches(rng, 1500), params=truth, noise=0.02, seed=4)
    tr.end_s = np.arange(len(tr)) * 0.012
    held = T.generate_trace(kernel, serving_batches(rng, 400), params=truth, noise=0.02, seed=5)
    return tr, held


@pytest.fixture(scope="module")
def calibrated(kernel, synthetic):
    tr, held = synthetic
    return S.calibrate_steps(tr, [("second run", held)], kernel=kernel, steps=300)


def test_recovers_the_engine_constants(calibrated):
    """1,500 steps, 2 % noise: each constant within its stated tolerance of the truth and
    within 3 standard errors (the time split fits on the first 70 %)."""
    fit = calibrated.fit
    assert fit.steps_fit == 1050 and fit.steps_held == 450
    for n, v in TRUTH.items():
        assert fit.laplace.identifiable[n], n
        got, se = fit.values[n], fit.laplace.se_value[n]
        assert got == pytest.approx(v, rel=TOLERANCE[n]), n
        assert abs(got - v) <= 3 * se, (n, got, v, se)


def test_residual_terms_point_at_the_missing_constants(kernel, synthetic):
    """The catalog's misses on the synthetic run: a per-step offset near host_serial and a
    per-request slope near host_serial_per_request on decode steps."""
    tr, _ = synthetic
    r = S.residual_terms(kernel, kernel.params, tr)["decode"]
    assert r["per_step_s"] == pytest.approx(TRUTH["host_serial"], rel=0.15)
    assert r["per_request_s"] == pytest.approx(TRUTH["host_serial_per_request"], rel=0.2)


def test_collinear_candidates_are_named(calibrated):
    """kernel_gap (one kernel count) and hbm_derate (one model's weights) are the same
    direction as host_serial in one model's trace: named, not fitted."""
    assert calibrated.r2["kernel_gap"] > S.COLLINEAR
    assert calibrated.r2["hbm_derate"] > S.COLLINEAR
    assert set(calibrated.not_identified) >= {"kernel_gap", "hbm_derate"}
    assert calibrated.r2["compute_derate"] < 0.5


def test_errors_before_and_after_on_held_out_runs(calibrated):
    """After the fit the held-out medians sit at the noise level (2 % noise: median |log| ≈
    0.013), before it they carry the missing constants."""
    by = {(s["part"], s["when"]): s for s in calibrated.summaries}
    for part in ("last 30% of the fitted run", "second run"):
        assert by[(part, "before")]["decode"] > 0.04
        assert by[(part, "after")]["decode"] < 0.02
        assert by[(part, "after")]["prefill"] < 0.03
        assert by[(part, "after")]["slope_ratio"] == pytest.approx(1.0, abs=0.15)
    t = calibrated.tables
    assert set(t.kind) == {"decode", "prefill"} and "all" in set(t.batch)


def test_unhidden_host_time_adds_after_the_maximum(kernel):
    """The "host serial" term: expected_s grows by exactly host_serial + per_request × live
    requests, jitted and not; the edges do not move."""
    b = jkernel.Batch([1] * 5, [1000] * 5)
    base = kernel.step_time(b)
    k2 = kernel.with_params(kernel.params.replace(host_serial=300e-6,
                                                  host_serial_per_request=20e-6))
    est = k2.step_time(b)
    assert float(est.expected_s) - float(base.expected_s) == pytest.approx(400e-6, rel=1e-9)
    assert float(est.overlap_s) == pytest.approx(float(base.overlap_s), rel=1e-12)
    table = k2.breakdown(b)
    serial = table[table.term == "host serial"].iloc[0]
    assert serial.expected_s == pytest.approx(400e-6, rel=1e-9)
    assert serial.host_s == 0.0 and serial.sm_s == 0.0
    jitted = jax.jit(lambda p: k2.step_fn(p, k2.batch_arrays(b)).expected_s)(k2.params)
    assert float(jitted) == pytest.approx(float(est.expected_s), rel=1e-12)


def test_compute_derate_slows_compute_bound_steps_only(kernel):
    """compute_derate scales the compute peak: a 1k-token prefill (compute-bound) slows by
    about 1/derate, a one-request decode (weight read) barely moves."""
    k2 = kernel.with_params(kernel.params.replace(compute_derate=0.8))
    pre, dec = jkernel.Batch([1024], [0]), jkernel.Batch([1], [1000])
    r_pre = float(k2.step_time(pre).expected_s) / float(kernel.step_time(pre).expected_s)
    r_dec = float(k2.step_time(dec).expected_s) / float(kernel.step_time(dec).expected_s)
    assert 1.15 < r_pre <= 1.25 + 1e-9
    assert r_dec < 1.02


def test_held_out_part_is_the_fits_own_split(calibrated, synthetic):
    """The report's "last 30 %" rows are the steps the fit held out (data.heldout.held_out
    on end_s), not a second copy of the rule: every one after every fitted step."""
    tr, _ = synthetic
    held = calibrated.fit.held
    assert held.sum() == calibrated.fit.steps_held
    np.testing.assert_array_equal(held, tr.held_mask(0.3, split="time"))
    assert tr.end_s[~held].max() < tr.end_s[held].min()
    t = calibrated.tables
    part = t[(t.part == "last 30% of the fitted run") & (t.batch == "all") & (t.when == "after")]
    assert part.steps.sum() == held.sum()


def test_validate_tables_count_every_usable_step(kernel, synthetic):
    tr, _ = synthetic
    t = V.step_errors(kernel, kernel.params, tr)
    kinds, size, usable = V.step_kinds(tr)
    assert t[t.batch == "all"].steps.sum() == usable.sum()
    assert t[t.batch != "all"].steps.sum() == usable.sum()


# -- the shipped constants ---------------------------------------------------------------------

ENGINE = ("host_serial", "host_serial_per_request", "compute_derate")
DEFAULTS = {"host_serial": 0.0, "host_serial_per_request": 0.0, "compute_derate": 1.0}


def _scenarios_on(chip, at_most=None):
    """Kernels of the catalog's colocated scenarios on ``chip`` (read from the scenario
    files' first document, so only those are opened)."""
    import yaml
    out = []
    for name in jkernel.catalog.list_scenarios():
        docs = list(yaml.safe_load_all(jkernel.catalog.scenario_path(name).read_text()))
        dep = next((d for d in docs if d.get("kind") == "Deployment"), {})
        if docs[0].get("cluster", {}).get("hardware") != chip or \
                any(p.get("role", "colocated") != "colocated" for p in dep.get("pools", [])):
            continue
        out.append(jkernel.open(name))
        if at_most and len(out) >= at_most:
            break
    return out


@pytest.fixture(scope="module")
def h100_kernels():
    ks = _scenarios_on("h100")
    assert len(ks) >= 5
    return ks


def test_every_h100_scenario_gets_the_same_engine_constants(h100_kernels):
    """The step-trace constants are engine-level: every H100 scenario of the standard sets
    reads the same fitted values (from the same entries), whatever the model; their
    provenance names the measured runs."""
    vals = {tuple(k.params.value(n) for n in ENGINE) for k in h100_kernels}
    assert len(vals) == 1
    hs, hpr, cd = vals.pop()
    assert 100e-6 < hs < 2e-3 and 0 < hpr < 100e-6 and 0.5 < cd <= 1.0
    for k in h100_kernels:
        prov = {p.name: p for p in k.provenance()}
        for n in ENGINE:
            assert prov[n].method == "fitted", (k, n)


def test_other_h100_models_shift_by_the_same_engine_terms(h100_kernels):
    """Re-pricing every H100 model with the fitted constants against the profiles-only
    values: a decode batch of n requests moves by exactly host_serial + n ×
    host_serial_per_request in every model (the unhidden host time does not depend on the
    model), and a 2k-token prefill's GPU part slows by more than 1 and at most
    1/compute_derate (the same clock derate on each model's compute share; a hybrid model's
    recurrent mixers are priced by rate, not FLOPs, so its share is smaller)."""
    sizes = (1, 8, 32)
    batches = [jkernel.Batch([1] * n, [2000] * n) for n in sizes] + [jkernel.Batch([2048], [0])]
    for k in h100_kernels:
        p = k.params
        hs, hpr, cd = (p.value(n) for n in ENGINE)

        def priced(**values):   # one program per kernel for all four batches and params sets
            return np.asarray(k.with_params(p.replace(**values)).price_many(batches).expected_s,
                              float)
        before = priced(**DEFAULTS)
        no_derate = priced(compute_derate=1.0)
        host_only = priced(host_serial=0.0, host_serial_per_request=0.0)
        for i, n in enumerate(sizes):
            assert no_derate[i] - before[i] == pytest.approx(hs + n * hpr, rel=1e-9), (k, n)
        ratio = host_only[-1] / before[-1]
        assert 1.0 < ratio <= 1 / cd + 1e-9, (k, ratio)


def test_chips_without_step_traces_keep_profile_values():
    """No step trace was measured on other chips: their engine constants stay at the
    profile-only defaults (recorded as jkernel's assumptions)."""
    for k in _scenarios_on("h200", 2) + _scenarios_on("b200", 1):
        for n, v in DEFAULTS.items():
            assert k.params.value(n) == v
            assert k.assumption(n) is not None
