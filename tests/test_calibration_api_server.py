"""The API server's work fitted from serving runs (jkernel/calibration/fit/api_server.py):
recovery from replays it generated, the test that keeps it, the likelihood it uses."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import jkernel
from jkernel.calibration.data.serving import GroupMeasure, ServingRun
from jkernel.calibration.fit import api_server as fa

SCENARIO = "qwen3-14b-h100-tp1"


def _runs(kernel, rates, n: int = 120, *, seed: int = 3, clock: str = "client") -> list:
    """One fit run per rate: ``n`` requests replayed on ``kernel``; the measured group is
    the replay's mean TTFT and E2E with 0.5 % noise."""
    from jkernel.replay import replay, validate_requests

    rng = np.random.default_rng(seed)
    runs = []
    for i, rate in enumerate(rates):
        r = np.random.default_rng(seed + i)
        df = pd.DataFrame({"request_id": np.arange(n),
                           "arrival_s": np.cumsum(r.exponential(1.0 / rate, n)),
                           "input_tokens": r.integers(300, 900, n),
                           "output_tokens": np.full(n, 48)})
        res = replay(kernel, df)
        t = res.requests["ttft_s"].mean() * (1 + rng.normal(0, 0.005))
        e = res.requests["e2e_s"].mean() * (1 + rng.normal(0, 0.005))
        runs.append(ServingRun(f"load{rate:g}", "synthetic", SCENARIO, validate_requests(df),
                               (GroupMeasure(-1, "all", n, 48.0, t, e),), clock=clock,
                               split="fit"))
    return runs


GRID = (0.0, 0.5e-3, 1e-3, 2e-3)


def test_the_fit_recovers_a_known_token_time_and_keeps_it():
    """Loads replayed with 1 ms of API-server time per streamed token (a queue at the busy
    loads): the grid's best point is the truth, the test keeps it, its interval holds it."""
    jkernel.enable_x64()
    k = jkernel.open(SCENARIO)
    truth = k.with_params(k.params.replace(host_api_server_per_token=1e-3))
    runs = _runs(truth, (4.0, 10.0, 18.0, 26.0, 36.0))
    fit = fa.fit_api_server(runs, {r.label: k for r in runs},
                            admission_s=float(k.params["host_admission_per_request"]),
                            token_grid_s=GRID, request_grid_s=(0.0,), sample=0)
    assert fit.kept and fit.test[0] > fit.test[1]
    assert fit.per_token_s == pytest.approx(1e-3) and fit.per_request_s == 0.0
    lo, hi = fit.ci95["host_api_server_per_token"]
    assert lo <= 1e-3 <= hi
    assert fit.values() == {"host_api_server_per_request": 0.0,
                            "host_api_server_per_token": pytest.approx(1e-3)}
    assert abs(fit.shift_s) < 2e-3


def test_without_work_in_the_runs_none_is_kept():
    """Runs replayed with no API-server work: the test does not reject none, nothing is
    written (values() is empty)."""
    jkernel.enable_x64()
    k = jkernel.open(SCENARIO)
    runs = _runs(k, (4.0, 10.0, 18.0, 26.0, 36.0))
    fit = fa.fit_api_server(runs, {r.label: k for r in runs},
                            admission_s=float(k.params["host_admission_per_request"]),
                            token_grid_s=GRID, request_grid_s=(0.0,), sample=0)
    assert not fit.kept and fit.values() == {}
    assert fit.per_token_s == 0.0


def test_too_few_groups_fit_nothing_and_say_why():
    """Four groups cannot fit two times, the shift and a scale: nothing is replayed or
    kept, and the reason is given."""
    k = jkernel.open(SCENARIO)
    runs = _runs(k, (4.0, 10.0, 18.0, 26.0), n=20)
    fit = fa.fit_api_server(runs, {r.label: k for r in runs}, admission_s=0.01)
    assert not fit.kept and fit.replays == 0 and "fewer than 5" in fit.reason


def test_runs_on_the_engine_clock_are_refused():
    """The engine's clock starts after the API server: no run measures its queue."""
    k = jkernel.open(SCENARIO)
    runs = _runs(k, (4.0,), n=20, clock="engine")
    with pytest.raises(ValueError, match="client's clock"):
        fa.fit_api_server(runs, {r.label: k for r in runs}, admission_s=0.01)


def test_the_likelihood_profiles_out_its_scale():
    """cauchy_nll(c·r) = cauchy_nll(r) + n·log c: the scale is profiled out, so the loss
    does not depend on the units of the residuals' spread (up to the bounded search)."""
    r = np.random.default_rng(1).standard_cauchy(40) * 0.05
    for c in (0.5, 2.0, 4.0):
        assert fa.cauchy_nll(c * r) == pytest.approx(fa.cauchy_nll(r) + 40 * math.log(c),
                                                     abs=1e-3)


def test_the_shift_only_lowers_the_front_end_and_stops_at_its_bound():
    """Predictions 10 ms too long are shifted down by 10 ms; predictions too short are not
    shifted up; a bound above −10 ms is where the shift stops."""
    tm = np.array([0.05, 0.06, 0.08, 0.1])
    loss, d = fa.shifted_loss(tm + 0.01, tm, [], [], lower_s=-0.05)
    assert d == pytest.approx(-0.01, abs=1e-4)
    _, d = fa.shifted_loss(tm - 0.01, tm, [], [], lower_s=-0.05)
    assert d == 0.0
    _, d = fa.shifted_loss(tm + 0.01, tm, [], [], lower_s=-0.004)
    assert d == pytest.approx(-0.004, abs=1e-6)
