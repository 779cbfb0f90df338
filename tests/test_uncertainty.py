"""The uncertainty package's parts on their own: the error-model document (strict, round
trip), the posterior of the constants (from the coefficient sets' standard errors, with a
fit's correlations), extrapolation flags, the estimation from residuals (recovering known
spreads), interval statistics (covering at the stated rate), source shares and P(SLA)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

import jkernel
from jkernel.errors import Refusal
from jkernel.regimes import REGIMES, Regime
from jkernel.uncertainty.errormodel import (CLASSES, Correlation, ErrorModel, FittedRange,
                                            FrontEnd, Spread, dump_error_model,
                                            error_model_to_dict, load_error_model,
                                            parse_error_model, shipped_error_model)
from jkernel.uncertainty.estimate import (GroupResidual, StepResiduals, estimate, step_jitter,
                                          systematic, weighted_spread)
from jkernel.uncertainty.extrapolation import assess, deployment_facts
from jkernel.uncertainty.intervals import SOURCES, interval, shares
from jkernel.uncertainty.posterior import Posterior
from jkernel.uncertainty.sla import sla_probability

RANGE = FittedRange(("h100",), ("qwen3-14b",), (1,), ("0.23.0",), 13, 2012, 1158, "test")


def _model(sd=0.05, jitter=0.02, front=(0.008, 0.003), bias=0.0) -> ErrorModel:
    sys_ = {c: tuple(Spread(bias, sd * (1 + i)) for _ in REGIMES) for i, c in enumerate(CLASSES)}
    return ErrorModel("test", tuple(Spread(0.0, jitter) for _ in REGIMES), sys_,
                      FrontEnd(*front), RANGE)


# -- the document --------------------------------------------------------------------------

def test_error_model_round_trips_through_its_document(tmp_path):
    m = _model()
    m = ErrorModel(m.name, m.step_jitter, m.systematic, m.front_end, m.fitted_range,
                   (Correlation(("a", "b"), ((1.0, -0.5), (-0.5, 1.0)), "fit"),),
                   "cmd", "abc", ("a note",))
    path = tmp_path / "em.yaml"
    path.write_text(dump_error_model(m))
    back = load_error_model(path)
    assert error_model_to_dict(back) == error_model_to_dict(m)
    assert back.spread("other_deployment", Regime.MIXED).sd == pytest.approx(0.15)
    assert back.file == str(path)


@pytest.mark.parametrize("change, key", [
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d["systematic"]["fitted"]["decode"].update(sd=-1.0), "systematic.fitted.decode.sd"),
    (lambda d: d["systematic"].pop("unfitted_chip"), "systematic.unfitted_chip"),
    (lambda d: d["step_jitter"]["host"].update(unit="years"), "step_jitter.host.unit"),
    (lambda d: d.update(correlations=[{"names": ["a", "b"], "matrix": [[1, 2], [2, 1]]}]),
     "correlations[0].matrix"),
])
def test_a_bad_document_is_refused_naming_the_key(change, key):
    doc = error_model_to_dict(_model())
    change(doc)
    with pytest.raises(Refusal) as exc:
        parse_error_model(doc, "em.yaml")
    assert exc.value.field == key and "em.yaml" in str(exc.value)


def test_the_shipped_error_model_reads_and_states_its_sources():
    m = shipped_error_model()
    assert m.name == "shipped" and m.command.startswith("python -m validation.error_model")
    for c in CLASSES:
        for reg, s in zip(REGIMES, m.systematic[c]):
            assert s.sd >= 0 and (s.source or s.borrowed_from), (c, reg)
    # farther from the fitted data is never narrower
    for a, b in zip(CLASSES, CLASSES[1:]):
        assert (m.log_sd(b) >= m.log_sd(a) - 1e-12).all()
    assert m.fitted_range.hardware and m.fitted_range.max_requests > 0
    assert m.front_end.count >= 3


# -- the posterior -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen():
    jkernel.enable_x64()
    return jkernel.open("qwen3-14b-h100-tp1")


def test_posterior_reads_the_selected_entries_standard_errors(qwen):
    p = Posterior.from_kernel(qwen)
    i = p.names.index("host_serial")
    # the shipped entry for H100 at vLLM 0.23 (read from the document, not through jkernel)
    doc = yaml.safe_load((Path(__file__).resolve().parents[1] / "catalog" / "coefficients"
                          / "cost-model-host-overheads.yaml").read_text())
    (entry,) = [e["host_serial"] for e in doc["coefficients"] if "host_serial" in e
                and "h100" in e["host_serial"]["scope"]["hardware"]
                and e["host_serial"]["scope"].get("engine_version", {}).get("from")
                in (None, "0.23.0")]
    assert p.sd[i] == pytest.approx(entry["standard_error"] / entry["value"], rel=1e-3)
    assert p.values[i] == pytest.approx(float(qwen.params["host_serial"]))
    assert "cost-model-host-overheads" in p.origins[i]
    assert all(n in qwen.params for n in p.names)
    assert np.allclose(p.cov, np.diag(p.sd ** 2))          # no correlations given


def test_posterior_joins_a_fits_correlations_and_draws_them(qwen):
    names = ("host_serial", "host_serial_per_request")
    cor = Correlation(names, ((1.0, -0.87), (-0.87, 1.0)), "the step fit")
    m = _model()
    m = ErrorModel(m.name, m.step_jitter, m.systematic, m.front_end, m.fitted_range, (cor,))
    p = Posterior.from_kernel(qwen, m)
    i, j = p.names.index(names[0]), p.names.index(names[1])
    assert p.cov[i, j] == pytest.approx(-0.87 * p.sd[i] * p.sd[j])
    d = p.log_scales(20000, np.random.default_rng(0))
    r = np.corrcoef(d[:, i], d[:, j])[0, 1]
    assert r == pytest.approx(-0.87, abs=0.02)
    assert np.std(d[:, i]) == pytest.approx(p.sd[i], rel=0.03)


def test_posterior_from_a_laplace_fit_keeps_the_identifiable_names():
    from jkernel.calibration.fit.uncertainty import Laplace

    lap = Laplace(("a", "b", "c"), np.log([1.0, 2.0, 3.0]),
                  np.array([[0.01, 0.002, 0], [0.002, 0.04, 0], [0, 0, 9.0]]), 0.1, 100,
                  {"a": True, "b": True, "c": False}, {"a": "", "b": "", "c": "x"},
                  {}, {}, {}, 1.0)
    p = Posterior.from_laplace(lap)
    assert p.names == ("a", "b")
    np.testing.assert_allclose(p.values, [1.0, 2.0])
    np.testing.assert_allclose(p.cov, [[0.01, 0.002], [0.002, 0.04]])


# -- extrapolation -------------------------------------------------------------------------

def test_the_fitted_deployment_is_in_range_and_other_deployments_say_why(qwen):
    m = _model()
    assert assess(qwen, m).cls == "fitted" and not assess(qwen, m).flags
    llama = jkernel.open("llama-3.1-70b-h100-tp4")
    ext = assess(llama, m)
    assert ext.cls == "other_deployment"
    assert {f.what for f in ext.flags} == {"model", "tp", "engine_version"}
    assert "llama-3.1-70b-instruct" in ext.describe()
    h200 = jkernel.open("llama-3.1-70b-instruct-h200-fp8-tp8")
    ext = assess(h200, m)
    assert ext.cls == "unfitted_chip"
    chip = [f for f in ext.flags if f.what == "chip"][0]
    assert "host_serial" in chip.why and "h200" in chip.why
    assert deployment_facts(h200).tp == 8


def test_batches_beyond_the_fitted_ones_raise_the_class_of_the_fitted_deployment(qwen):
    import pandas as pd

    m = _model()
    small = pd.DataFrame({"requests": [3, 5, 13], "tokens": [3, 600, 1100]})
    big = pd.DataFrame({"requests": [3, 40, 40], "tokens": [3, 40, 40]})
    assert assess(qwen, m, steps=small).cls == "fitted"
    ext = assess(qwen, m, steps=big)
    assert ext.cls == "fitted_deployment"
    assert "67%" in ext.flags[0].why and "40 requests" in ext.flags[0].why


# -- estimation ----------------------------------------------------------------------------

def test_weighted_spread_weighs_every_deployment_alike():
    mean, sd, units = weighted_spread([0.0, 0.0, 0.0, 1.0], ["a", "a", "a", "b"])
    assert units == 2 and mean == pytest.approx(0.5)
    assert sd == pytest.approx(math.sqrt(0.5 * 1.5))


def _synthetic_groups(rng, cls, bias, sd, deployments, groups=3, front=(0.008, 0.002)):
    out = []
    for d in range(deployments):
        e = bias + sd * rng.standard_normal()
        f = front[0] + front[1] * rng.standard_normal()
        for g in range(groups):
            out.append(GroupResidual("syn", f"{cls}-{d}-{g}", "all", f"{cls}-{d}", "chip", cls,
                                     e, f if g == 0 else math.nan))
    return out


def test_estimation_recovers_known_spreads_within_sampling_error():
    rng = np.random.default_rng(0)
    truth = {"fitted": (0.0, 0.01), "fitted_deployment": (0.01, 0.02),
             "other_deployment": (-0.03, 0.10), "unfitted_chip": (0.1, 0.25)}
    groups, n = [], 60
    for c, (b, s) in truth.items():
        groups += _synthetic_groups(rng, c, b, s, n, groups=1 if "fitted" in c else 3)
    steps = [StepResiduals(f"run{i}", rng.integers(0, 3, 5000),
                           0.02 * rng.standard_normal(5000)) for i in range(2)]
    m = estimate(steps, groups)
    for c, (b, s) in truth.items():
        got = m.spread(c, Regime.DECODE)
        assert got.bias == pytest.approx(b, abs=3 * s / math.sqrt(n)), c
        assert got.sd == pytest.approx(s, rel=0.3), c
        assert got.count == n
    assert m.jitter_sd()[Regime.DECODE] == pytest.approx(0.02, rel=0.05)
    assert m.front_end.bias_s == pytest.approx(0.008, abs=0.001)
    assert m.front_end.sd_s == pytest.approx(0.002, rel=0.3)


def test_thin_classes_and_regimes_borrow_and_say_from_where():
    rng = np.random.default_rng(1)
    groups = (_synthetic_groups(rng, "other_deployment", 0.0, 0.1, 6)
              + _synthetic_groups(rng, "unfitted_chip", 0.0, 0.05, 2))
    steps = [StepResiduals("r", np.full(1000, Regime.DECODE), 0.02 * rng.standard_normal(1000))]
    jit = step_jitter(steps)
    assert jit[Regime.PREFILL].borrowed_from == "decode"
    assert jit[Regime.HOST].borrowed_from == "decode"
    sysm = systematic(steps, groups)
    # no fitted data: the nearest class with data, the farther side first
    assert sysm["fitted"][Regime.DECODE].borrowed_from == "other_deployment"
    # two chips are too few: borrowed from the nearer class, and never narrower than it
    unf = sysm["unfitted_chip"][Regime.DECODE]
    assert unf.borrowed_from == "other_deployment"
    assert unf.sd >= sysm["other_deployment"][Regime.DECODE].sd
    assert sysm["other_deployment"][Regime.PREFILL].borrowed_from == "mixed"


# -- intervals, shares, SLA ----------------------------------------------------------------

def test_prediction_intervals_cover_a_new_draw_at_their_level():
    rng = np.random.default_rng(2)
    for level in (0.5, 0.8):
        hits, trials = 0, 4000
        for _ in range(trials):
            x = np.exp(0.3 * rng.standard_normal(17) + 1.0)
            _, lo, hi = interval(x[:16], level)
            hits += lo <= x[16] <= hi
        # binomial standard error at 4000 trials is below 0.008
        assert hits / trials == pytest.approx(level, abs=0.025)


def test_empirical_and_degenerate_intervals():
    x = np.exp(np.linspace(-1, 1, 101))
    c, lo, hi = interval(x, 0.8, method="empirical")
    assert c == pytest.approx(1.0) and lo == pytest.approx(math.exp(-0.8))
    assert interval([2.0, 2.0, 2.0], 0.8) == (2.0, 2.0, 2.0)
    assert all(math.isnan(v) for v in interval([math.nan], 0.8))
    with pytest.raises(ValueError):
        interval(x, 1.5)


def test_shares_attribute_the_variance_to_the_sources_that_move_it():
    rng = np.random.default_rng(3)
    k = 64
    a, b = rng.standard_normal(k), rng.standard_normal(k)
    y = np.exp(0.3 * a + 0.1 * b)              # variance 0.09 : 0.01
    s = shares(y, {"structural": a, "front_end": b, "constants": np.zeros(k)})
    assert set(s) == set(SOURCES)
    assert s["structural"] == pytest.approx(0.9, abs=0.05)
    assert s["front_end"] == pytest.approx(0.1, abs=0.05)
    assert s["constants"] == 0.0 and s["other"] < 0.02
    assert sum(s.values()) == pytest.approx(1.0)


def test_a_point_estimate_just_at_the_target_has_probability_one_half():
    rng = np.random.default_rng(4)
    x = np.exp(0.1 * rng.standard_normal(2000))
    out = sla_probability({"itl_p90_s": x}, {"itl_p90_s": 1.0})
    assert out.probability == pytest.approx(0.5, abs=0.03)
    assert out.fraction == pytest.approx(0.5, abs=0.03)
    assert abs(out.margin) < 0.01 and out.binding == "itl_p90_s"


def test_sla_probability_of_two_correlated_targets():
    rng = np.random.default_rng(5)
    z = rng.standard_normal(4000)
    draws = {"ttft_p90_s": np.exp(0.2 * z), "itl_p90_s": 0.05 * np.exp(0.1 * z)}
    # perfectly correlated: both met exactly when z ≤ 1 (the ITL target binds)
    out = sla_probability(draws, {"ttft_p90_s": math.exp(0.4), "itl_p90_s": 0.05 * math.exp(0.1)})
    assert out.probability == pytest.approx(0.8413, abs=0.02)
    assert out.binding == "itl_p90_s"
    assert sla_probability(draws, {"ttft_p90_s": 0.0, "itl_p90_s": 0.0}).probability == 1.0
    fixed = {"itl_p90_s": np.full(10, 0.06)}
    assert sla_probability(fixed, {"itl_p90_s": 0.05}).probability == 0.0
    assert sla_probability(fixed, {"itl_p90_s": 0.07}).probability == 1.0


@pytest.mark.parametrize("scenario", [
    "qwen3-14b-h100-tp1",
    str(Path(__file__).resolve().parents[1] / "validation" / "scenarios"
        / "llama-2-7b-h100-tp1-vllm0.15.yaml")], ids=["vllm0.23", "vllm0.15"])
def test_the_posterior_reads_the_entries_the_kernel_selected_for_its_engine_version(scenario):
    """Entries scoped by engine version (the step-trace fit from vLLM 0.23 on, a serving fit
    below it): the posterior and the extrapolation flags read the one the kernel priced with.
    (Defect: they selected without the version, found no H100 step constants and called the
    fitted deployment an unfitted chip.)"""
    from jkernel.uncertainty.posterior import selected_entries

    jkernel.enable_x64()
    k = jkernel.open(scenario)
    chosen = selected_entries(k)
    version = k.inputs.scenario.engine_version
    for name in ("host_serial", "compute_derate", "host_admission_per_request"):
        e = chosen[name]
        assert e.scope.engine_version is None or e.scope.engine_version.contains(version)
        scale = 1e-6 if e.units.startswith("us") else 1.0
        assert e.value * scale == pytest.approx(float(k.params[name]), rel=1e-12), name
    if version == "0.23.0":                     # the step-trace fit's own deployment
        assert not [f for f in assess(k, shipped_error_model()).flags if f.what == "chip"]
