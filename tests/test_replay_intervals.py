"""Intervals through the replay (jkernel.replay.intervals): what an interval replay reports,
and that replays generated with known constants and known noise, by the plain replay on
its own, are covered at the stated rate within sampling error."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import jkernel
from jkernel.regimes import REGIMES, classify
from jkernel.replay import replay
from jkernel.replay.intervals import format_intervals, intervals_table, replay_intervals
from jkernel.uncertainty.errormodel import (CLASSES, ErrorModel, FittedRange, FrontEnd,
                                            Spread, dump_error_model)
from jkernel.uncertainty.intervals import METRICS, SOURCES, interval
from jkernel.uncertainty.posterior import Posterior

from conftest import ROOT

RANGE = FittedRange(("h100",), ("qwen3-14b",), (1,), ("0.23.0",), 64, 8192, 4096, "test")


def _model(sd=0.08, jitter=0.02, front=(0.004, 0.002)) -> ErrorModel:
    sys_ = {c: tuple(Spread(0.0, sd) for _ in REGIMES) for c in CLASSES}
    return ErrorModel("synthetic", tuple(Spread(0.0, jitter) for _ in REGIMES), sys_,
                      FrontEnd(*front), RANGE)


@pytest.fixture(scope="module")
def kernel():
    jkernel.enable_x64()
    return jkernel.open("qwen3-14b-h100-tp1")


def _requests(n=30, rate=2.0, seed=0):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"request_id": np.arange(n),
                         "arrival_s": np.cumsum(rng.exponential(1.0 / rate, n)),
                         "input_tokens": rng.integers(200, 600, n),
                         "output_tokens": rng.integers(30, 60, n)})


def test_an_interval_replay_reports_every_metric_with_its_sources(kernel):
    from dataclasses import replace

    reqs = _requests()
    stale = replace(_model(), constants_sha256="0" * 64, command="regenerate-me")
    res = replay_intervals(kernel, reqs, draws=8, error_model=stale)
    assert set(res.metrics) == set(METRICS)
    plain = replay(kernel, reqs)
    for m in METRICS:
        iv = res.metrics[m]
        assert iv.point == pytest.approx(plain.summary[m], rel=1e-12), m
        assert iv.low <= iv.central <= iv.high and len(iv.draws) == 8
        assert set(iv.shares) == set(SOURCES)
        assert sum(iv.shares.values()) == pytest.approx(1.0)
    ttft = res.metrics["ttft_mean_s"]
    # the front end is drawn around 4 ms: the TTFT draws sit above the point estimate
    assert ttft.central > ttft.point
    assert res.metrics["itl_mean_s"].shares["structural"] > 0.8
    assert res.extrapolation.cls == "fitted"
    assert any("request table" in n for n in res.notes)
    # an error model estimated with other constants says so
    assert any("other constants" in n and "regenerate-me" in n for n in res.notes)
    assert res.iterations >= plain.summary["steps"]
    text = format_intervals(res)
    assert "TTFT mean ms" in text and "80% interval" in text
    assert len(intervals_table(res)) == len(METRICS)


def test_only_the_sources_asked_for_are_drawn(kernel):
    reqs = _requests(n=12)
    res = replay_intervals(kernel, reqs, draws=4, error_model=_model(),
                           sources=("constants",))
    ttft = res.metrics["ttft_mean_s"]
    # the constants' posterior alone moves TTFT by a few per cent at most, and no front
    # end is drawn (no draw is 4 ms above the point)
    assert max(ttft.draws) / min(ttft.draws) - 1 < 0.05
    assert max(ttft.draws) < ttft.point + 0.002
    assert res.metrics["itl_mean_s"].shares["structural"] == 0.0
    with pytest.raises(ValueError, match="unknown"):
        replay_intervals(kernel, reqs, draws=4, sources=("weather",))
    with pytest.raises(ValueError, match="either requests"):
        replay_intervals(kernel, draws=4)


def test_workload_seeds_are_a_source_of_their_own(kernel):
    from jkernel.replay import read_spec

    spec = read_spec({"seed": 3, "arrival": {"process": "poisson", "rate": 3.0, "count": 20},
                      "input_tokens": 300, "output_tokens": 24})
    res = replay_intervals(kernel, workload=spec, draws=8, seeds=4,
                           error_model=_model(0.001, jitter=0.0),
                           sources=("workload", "structural"))
    assert res.draws.workload.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # the arrivals move the latencies far more than a 0.1 % step error does
    for m in ("ttft_mean_s", "e2e_p90_s"):
        assert res.metrics[m].shares["workload"] > 0.8, m
    assert not res.notes


def _truth(kernel, factor: float, jitter: float, front_s: float, seed: int):
    """A copy of ``kernel`` whose every step costs ``factor`` times its price times a
    per-step log-normal jitter, with ``front_s`` before each request: the ground truth of
    a synthetic run, replayed by the plain replay (not the lockstep)."""
    import copy

    rng = np.random.default_rng(seed)
    step, admit = kernel.step_time, kernel.admission_overhead
    truth = copy.copy(kernel)

    def step_time(*args, **kw):
        est = step(*args, **kw)
        m = factor * math.exp(jitter * rng.standard_normal())
        return est._replace(expected_s=est.expected_s * m, no_overlap_s=est.no_overlap_s * m)

    def pricer(*args, **kw):                 # what the replay prices its steps with
        price = kernel.pricer(*args, **kw)
        return lambda *a: price(*a) * factor * math.exp(jitter * rng.standard_normal())

    truth.step_time = step_time
    truth.pricer = pricer
    truth.admission_overhead = lambda prompt: max(0.0, admit(prompt) + front_s)
    return truth


def test_synthetic_runs_with_known_constants_and_noise_are_covered_at_the_stated_rate(kernel):
    """Ground truth: each 'measured' run is the plain replay of a kernel at constants drawn
    from the posterior, with a known systematic step factor, per-step jitter and front end
    drawn from the error model; the intervals come from independent draws of the same model.
    With 120 truths and three metrics the coverage of each level is within sampling error
    (binomial, about 0.05 at 120 truths, plus the interval's own estimation from 32 draws;
    40 truths put the 50 % level's 0.35 within that error, which is why there are 120)."""
    em = _model(sd=0.08, jitter=0.03, front=(0.004, 0.002))
    reqs = _requests(n=24, rate=2.0, seed=11)
    post = Posterior.from_kernel(kernel)
    res = replay_intervals(kernel, reqs, draws=32, error_model=em, posterior=post, seed=5)
    rng = np.random.default_rng(99)
    truths = []
    for i in range(120):
        d = post.log_scales(1, rng)[0]
        params = kernel.params.replace(**{n: float(kernel.params[n]) * math.exp(x)
                                          for n, x in zip(post.names, d)})
        truth = _truth(kernel.with_params(params), math.exp(0.08 * rng.standard_normal()),
                       0.03, 0.004 + 0.002 * rng.standard_normal(), seed=i)
        truths.append(replay(truth, reqs).summary)
    for level in (0.5, 0.8):
        hits = []
        for m in ("ttft_mean_s", "itl_mean_s", "e2e_mean_s"):
            _, lo, hi = interval(res.metrics[m].draws, level)
            hits += [lo <= t[m] <= hi for t in truths]
        cov = float(np.mean(hits))
        assert abs(cov - level) < 0.1, (level, cov)


def test_replay_intervals_command_line(tmp_path):
    em = tmp_path / "em.yaml"
    em.write_text(dump_error_model(_model()))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "jkernel", "replay", "qwen3-14b-h100-tp1",
                        "--requests", str(ROOT / "tests/data/residency-vllm/agg_2rps_head.csv"),
                        "--intervals", "0.8", "--draws", "4", "--error-model", str(em),
                        "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["level"] == 0.8 and doc["draws"] == 4
    rows = {r["metric"]: r for r in doc["metrics"]}
    assert rows["itl_mean_s"]["low"] <= rows["itl_mean_s"]["central"] <= rows["itl_mean_s"]["high"]
    assert doc["extrapolation"]["class"] == "fitted"
    bad = subprocess.run([sys.executable, "-m", "jkernel", "replay", "qwen3-14b-h100-tp1",
                          "--requests", str(ROOT / "tests/data/residency-vllm/agg_2rps_head.csv"),
                          "--intervals", "80"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert bad.returncode != 0 and "--intervals 80" in bad.stderr


def test_the_shipped_error_model_widens_an_unfitted_chip():
    from jkernel.uncertainty.errormodel import shipped_error_model

    m = shipped_error_model()
    assert m.log_sd("unfitted_chip")[0] > m.log_sd("fitted")[0]
    assert classify(np.array([[1, 1]]), 1).tolist() == [0]
