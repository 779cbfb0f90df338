"""Workload specs (jkernel.replay.spec): strict reading, the distributions, the arrival
processes, prompt pools, multi-turn sessions, and the worked example of docs/workloads.md
(the 15 inference-sim trainval runs) against their committed workload rows and an excerpt
of one run's request file."""

from __future__ import annotations

import copy
import math
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import jkernel
from jkernel import Refusal
from jkernel.replay import Clients, load_requests, load_workload, replay

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "workloads"
SPECS = ROOT / "docs" / "workloads" / "inference-sim-trainval"
SHARED = ROOT.parent.parent / "shared" / "data" / "serving-runs" / "inference-sim-trainval"
if not SHARED.exists():
    SHARED = Path("/work/shared/data/serving-runs/inference-sim-trainval")
sys.path.insert(0, str(ROOT / "examples"))
import trainval_workloads as T  # noqa: E402

BASE = {"seed": 3, "arrival": {"process": "poisson", "rate": 4.0, "count": 400},
        "input_tokens": 300, "output_tokens": 20}


def spec(**changes) -> dict:
    d = copy.deepcopy(BASE)
    d.update(changes)
    return d


@lru_cache(maxsize=None)
def qwen() -> jkernel.Kernel:
    return jkernel.open("qwen3-14b-h100-tp1")


# -- strict reading ------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field, allowed", [
    (dict(inputs=5), "inputs", "allowed here: arrival, clients, cooldown"),
    (dict(input_tokens=-5), "input_tokens", "a whole number ≥ 1"),
    (dict(output_tokens=0), "output_tokens", "a whole number ≥ 1"),
    (dict(output_tokens=2.5), "output_tokens", "a whole number ≥ 1"),
    (dict(input_tokens={"distribution": "normal", "mean": 300}), "input_tokens.std",
     "required key is missing"),
    (dict(input_tokens={"distribution": "normal", "mean": 300, "std": -1}),
     "input_tokens.std", "≥ 0"),
    (dict(input_tokens={"distribution": "zipf"}), "input_tokens.distribution",
     "allowed: fixed, uniform, normal, lognormal, exponential, histogram"),
    (dict(input_tokens={"distribution": "uniform", "min": -3, "max": 9}), "input_tokens.min",
     "≥ 1"),
    (dict(input_tokens={"distribution": "fixed", "value": 10, "sigma": 2}),
     "input_tokens.sigma", "unknown key 'sigma'"),
    (dict(input_tokens={"distribution": "histogram", "edges": [1, 10, 20], "counts": [3]}),
     "input_tokens.counts", "one count per bin"),
    (dict(input_tokens={"distribution": "histogram", "values": [100, -2], "weights": [1, 1]}),
     "input_tokens.values[1]", "≥ 1"),
    (dict(arrival={"process": "poisson", "rate": 4.0}), "arrival",
     "duration_s (int(rate × duration) arrivals) or count"),
    (dict(arrival={"process": "poisson", "rate": -1, "count": 3}), "arrival.rate", "> 0"),
    (dict(arrival={"process": "trickle", "count": 3}), "arrival.process",
     "allowed: poisson, constant, gamma, bursts, immediate"),
    (dict(arrival={"process": "poisson", "stages": [{"rate": 1, "count": 3, "length": 2}]}),
     "arrival.stages[0].length", "unknown key"),
    (dict(prefix={"groups": 0, "tokens": 10}), "prefix.groups", "≥ 1"),
    (dict(sessions={"turns": 0}), "sessions.turns", "≥ 1"),
    (dict(clients={"concurrency": 4, "think_s": 1}), "clients.think_s", "unknown key"),
    (dict(warmup={"fraction": 1.5}), "warmup.fraction", "fraction < 1"),
])
def test_a_bad_spec_is_refused_with_the_file_the_key_and_what_is_allowed(
        tmp_path, changes, field, allowed):
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec(**changes)))
    with pytest.raises(Refusal) as err:
        load_workload(path)
    assert err.value.file == str(path) and err.value.field == field
    assert allowed in str(err.value)


def test_a_missing_spec_file_and_bad_yaml_are_refused(tmp_path):
    with pytest.raises(Refusal, match="workload spec not found"):
        load_workload(tmp_path / "none.yaml")
    (tmp_path / "dup.yaml").write_text("seed: 1\nseed: 2\n")
    with pytest.raises(Refusal, match="given twice"):
        load_workload(tmp_path / "dup.yaml")


# -- distributions and arrivals ----------------------------------------------------------

def lengths(dist, n=20000, seed=0) -> np.ndarray:
    d = spec(seed=seed, input_tokens=dist,
             arrival={"process": "immediate", "count": n})
    return load_workload(d).requests["input_tokens"].to_numpy()


def test_length_distributions_have_their_moments_and_bounds():
    assert set(lengths(547, 100)) == {547}
    u = lengths({"distribution": "uniform", "min": 10, "max": 20})
    assert u.min() == 10 and u.max() == 20 and abs(u.mean() - 15) < 0.1
    assert set(np.unique(u)) == set(range(10, 21))
    nrm = lengths({"distribution": "normal", "mean": 500, "std": 50})
    assert abs(nrm.mean() - 500) < 2 and abs(nrm.std() - 50) < 2
    ln = lengths({"distribution": "lognormal", "mean": 400, "std": 300, "max": 100000})
    assert abs(ln.mean() / 400 - 1) < 0.03 and abs(ln.std() / 300 - 1) < 0.06   # moments
    clipped = lengths({"distribution": "normal", "mean": 50, "std": 100, "min": 20, "max": 60})
    assert clipped.min() == 20 and clipped.max() == 60
    h = lengths({"distribution": "histogram", "edges": [1, 101, 1001], "counts": [3, 1]})
    assert abs((h < 101).mean() - 0.75) < 0.01 and h.min() >= 1 and h.max() <= 1000
    assert abs(h[h < 101].mean() - 50.5) < 1                  # uniform inside its bin
    v = lengths({"distribution": "histogram", "values": [128, 2048], "weights": [9, 1]})
    assert set(np.unique(v)) == {128, 2048} and abs((v == 2048).mean() - 0.1) < 0.01


def arrivals(arrival: dict, seed=0) -> pd.DataFrame:
    return load_workload(spec(seed=seed, arrival=arrival)).requests


def test_arrival_processes():
    p = arrivals({"process": "poisson", "rate": 5.0, "count": 20000}).arrival_s.to_numpy()
    gaps = np.diff(np.concatenate([[0.0], p]))
    assert abs(gaps.mean() * 5 - 1) < 0.02 and abs(gaps.std() / gaps.mean() - 1) < 0.03
    c = arrivals({"process": "constant", "rate": 4.0, "count": 10}).arrival_s.to_numpy()
    assert np.allclose(c, np.arange(1, 11) / 4.0)              # first one gap after 0
    g = arrivals({"process": "gamma", "rate": 5.0, "burstiness": 0.25,
                  "count": 20000}).arrival_s.to_numpy()
    gg = np.diff(g)
    assert abs(gg.mean() * 5 - 1) < 0.05 and abs(gg.std() / gg.mean() - 2.0) < 0.1  # 1/√k
    b = arrivals({"process": "bursts", "size": 8, "interval_s": 2.5, "count": 20})
    assert b.arrival_s.tolist() == [0.0] * 8 + [2.5] * 8 + [5.0] * 4
    assert arrivals({"process": "immediate", "count": 5}).arrival_s.tolist() == [0.0] * 5


def test_stages_of_rates_with_inference_perfs_rescaling():
    t = arrivals({"process": "poisson", "rescale": True,
                  "stages": [{"rate": 2.5, "duration_s": 40}, {"rate": 6, "duration_s": 20},
                             {"rate": 1, "count": 7}]})
    counts = t.groupby("stage").size().tolist()
    assert counts == [100, 120, 7]                             # int(rate × duration)
    last = t.groupby("stage").arrival_s.max().tolist()
    assert last[0] == pytest.approx(40) and last[1] == pytest.approx(60)
    assert last[2] == pytest.approx(67)                        # count / rate after 60 s
    assert (t[t.stage == 1].arrival_s > 40).all()
    unscaled = arrivals({"process": "poisson",
                         "stages": [{"rate": 2.5, "duration_s": 40}]}).arrival_s.max()
    assert unscaled != pytest.approx(40)


def test_one_seed_one_workload():
    a = load_workload(spec(seed=5)).requests
    pd.testing.assert_frame_equal(a, load_workload(spec(seed=5)).requests)
    assert not a.arrival_s.equals(load_workload(spec(seed=6)).requests.arrival_s)


# -- prefixes, pools and sessions --------------------------------------------------------

def test_a_prompt_pool_is_shuffled_once_and_sent_in_turn():
    wl = load_workload(spec(
        arrival={"process": "immediate", "count": 250},
        input_tokens={"distribution": "uniform", "min": 50, "max": 500},
        output_tokens={"distribution": "uniform", "min": 5, "max": 50},
        prefix={"groups": 4, "tokens": {"distribution": "uniform", "min": 30, "max": 90},
                "prompts_per_group": 5}))
    r = wl.requests
    key = r.prompt_key.to_numpy()
    assert sorted(set(key[:20])) == list(range(20)) and (key[20:] == key[:-20]).all()
    assert key[:20].tolist() != list(range(20))                # shuffled
    assert (r.prefix_group == r.prompt_key // 5).all()         # pool index g × 5 + p
    # one prompt's lengths, one group's prefix
    assert (r.groupby("prompt_key")[["input_tokens", "output_tokens"]].nunique() == 1).all().all()
    assert (r.groupby("prefix_group").prefix_length.nunique() == 1).all()
    assert (r.input_tokens > r.prefix_length).all()
    grouped = load_workload(spec(arrival={"process": "immediate", "count": 40},
                                 prefix={"groups": 4, "tokens": 30, "prompts_per_group": 5,
                                         "order": "grouped"})).requests
    assert grouped.prompt_key.tolist() == list(range(20)) * 2


def test_pool_prompts_hit_the_prefix_cache_where_they_repeat():
    """Requests of one group share its prefix; a prompt sent again is a hit on all of its
    full blocks (while cached)."""
    d = spec(arrival={"process": "constant", "rate": 2.0, "count": 12},
             input_tokens=200, output_tokens=4,
             prefix={"groups": 2, "tokens": 64, "prompts_per_group": 3, "order": "grouped"})
    r = replay(qwen(), load_workload(d).requests).requests
    block = qwen().settings.block_size
    assert r.cached_tokens.iloc[0] == 0
    assert r.cached_tokens.iloc[1] == 64 // block * block       # same group, new prompt
    assert (r.cached_tokens.iloc[6:] == (264 - 1) // block * block).all()  # repeats


def test_sessions_grow_their_context_turn_by_turn():
    d = spec(arrival={"process": "poisson", "rate": 1.0, "count": 30},
             input_tokens={"distribution": "uniform", "min": 20, "max": 80},
             output_tokens={"distribution": "uniform", "min": 10, "max": 30},
             prefix={"groups": 3, "tokens": 50},
             sessions={"turns": {"distribution": "uniform", "min": 1, "max": 4},
                       "think_time_s": {"distribution": "exponential", "mean": 2.0}})
    r = load_workload(d).requests
    assert r.session_id.nunique() == 30 and len(r) > 30
    for _, s in r.groupby("session_id", sort=False):
        inp, out = s.input_tokens.to_numpy(), s.output_tokens.to_numpy()
        assert (inp[1:] > inp[:-1] + out[:-1]).all()                  # + a new question
        assert s.think_s.iloc[0] == 0 and (s.arrival_s == s.arrival_s.iloc[0]).all()
        assert s.prefix_length.nunique() == 1 and (inp[0] > s.prefix_length.iloc[0])
    res = replay(qwen(), r)
    rr = res.requests
    later = rr[rr.session_id.duplicated()]
    assert (later.cached_tokens > 0).all()
    assert (later.arrival_s > later.scheduled_s).all()         # sent after the previous turn


def test_a_pool_with_sessions_is_inference_perfs_multi_turn():
    d = spec(arrival={"process": "immediate", "count": 30},
             input_tokens=40, output_tokens=10,
             prefix={"groups": 2, "tokens": 16, "prompts_per_group": 5},
             sessions={"think_time_s": 0.5})
    r = load_workload(d).requests
    assert r.session_id.nunique() == 10
    rnd = np.arange(30) // 10
    assert (r.input_tokens == 16 + (rnd + 1) * 40 + rnd * 10).all()
    assert (r.think_s == np.where(rnd > 0, 0.5, 0.0)).all()


def test_clients_and_window_come_with_the_requests():
    wl = load_workload(spec(arrival={"process": "immediate", "count": 50},
                            clients={"concurrency": 4, "think_time_s": 0.1},
                            warmup={"fraction": 0.1}, cooldown={"seconds": 2}))
    assert wl.clients == Clients(4, 0.1)
    assert wl.window.warmup_fraction == 0.1 and wl.window.cooldown_s == 2.0
    res = replay(qwen(), wl.requests, clients=wl.clients, window=wl.window)
    assert res.summary["completed"] == res.requests.measured.sum() < 50


# -- the worked example: the inference-sim trainval runs -------------------------------

RUNS = pd.read_csv(DATA / "trainval_runs.csv")


@pytest.mark.parametrize("run_id", sorted(RUNS.run_id.unique()))
def test_trainval_spec_regenerates_its_runs_workload(run_id):
    """docs/workloads/inference-sim-trainval/<run>.yaml is the run's workload (runs.csv):
    its stages' requests and rates, the lengths, the 10 × 10 prompt pool."""
    run = RUNS[RUNS.run_id == run_id]
    assert (SPECS / f"{run_id}.yaml").read_text() == T.spec_text(run)
    r = load_workload(SPECS / f"{run_id}.yaml").requests
    whole = run[run.stage_index == -1].iloc[0]
    stages = run[run.stage_index >= 0].sort_values("stage_index")
    assert len(r) == whole.n_requests
    end = 0.0
    for st in stages.itertuples():
        mine = r[r.stage == st.stage_index]
        assert len(mine) == st.n_requests == st.stage_rate_rps * st.stage_duration_s
        end += st.stage_duration_s
        assert mine.arrival_s.max() == pytest.approx(end)
    assert (r.input_tokens == whole.system_prompt_len + whole.question_len).all()
    assert (r.output_tokens == whole.output_len).all()
    stats = T.statistics(r, list(stages.stage_duration_s))
    assert stats["groups"] == 10 and stats["prompts"] == 100 and stats["cycles_of_100"]
    assert stats["prefix_tokens"] == whole.system_prompt_len


def test_trainval_spec_matches_the_committed_request_file_excerpt():
    """The first 300 requests of run 63's request file (its first minute at 5 req/s) and
    the spec's first 300: the same lengths, groups, prompt cycle and (within sampling
    error) rate and gap spread; replayed, the same figures within sampling error."""
    rid = "63-mistral-nemo-12b-tp1-codegen-1-1"
    f = T.from_file(DATA / "trainval-63-head.csv")
    s = load_workload(SPECS / f"{rid}.yaml").requests.head(len(f))
    a, b = T.statistics(s, [60.0]), T.statistics(f, [60.0])
    for k in ("input_mean", "output_mean", "groups", "prompts", "prefix_tokens",
              "cycles_of_100", "prompts_per_group"):
        assert a[k] == b[k], k
    n = len(f)
    for t in (s, f):
        rate = n / t.arrival_s.max()
        assert abs(rate - 5.0) < 3 * 5.0 / math.sqrt(n)
        gaps = np.diff(t.arrival_s)
        assert abs(gaps.std() / gaps.mean() - 1) < 0.2
    rs, rf = replay(qwen(), s).summary, replay(qwen(), f).summary
    assert rs["completed"] == rf["completed"] == n
    for k in ("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "e2e_mean_s", "e2e_p90_s"):
        assert rs[k] == pytest.approx(rf[k], rel=0.05), k
    # the throughput is the offered load: requests over the arrival span (which is
    # sampling noise for a fixed count: the 300th of a 5 req/s stream comes at 60 ± 3.5 s)
    for sm, t in ((rs, s), (rf, f)):
        assert sm["requests_per_s"] == pytest.approx(n / t.arrival_s.max(), rel=0.1)


@pytest.mark.skipif(not (SHARED / "runs.csv").exists(), reason="needs ../shared")
def test_trainval_specs_regenerate_every_request_files_statistics():
    runs = pd.read_csv(SHARED / "runs.csv")
    for run_id, run in runs.groupby("run_id"):
        durations = list(run[run.stage_index >= 0].sort_values("stage_index").stage_duration_s)
        a = T.statistics(load_workload(SPECS / f"{run_id}.yaml").requests, durations)
        b = T.statistics(T.from_file(SHARED / "requests" / f"{run_id}.csv"), durations)
        for k in a:
            if k.endswith("gap_cv"):
                assert a[k] == pytest.approx(b[k], abs=0.1), (run_id, k)
            else:
                assert a[k] == pytest.approx(b[k]) if isinstance(a[k], float) else a[k] == b[k]


def test_a_spec_replays_through_load_requests_unchanged(tmp_path):
    """A generated table written to CSV and read back replays to the same figures."""
    wl = load_workload(spec(prefix={"groups": 3, "tokens": 40, "prompts_per_group": 4}))
    path = tmp_path / "reqs.csv"
    wl.requests.to_csv(path, index=False)
    a = replay(qwen(), wl.requests).summary
    b = replay(qwen(), load_requests(path)).summary
    assert a == b
