"""The serving calibration: the run manifest and its refusals
(jkernel/calibration/data/serving.py), the replay's fixed point and the fit
(jkernel/calibration/fit/serving.py), the command on the committed excerpt."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import jkernel
from jkernel.calibration.data.heldout import held_out_runs
from jkernel.calibration.data.serving import (CHAT_CLOSE_TOKENS, WARM_UP_GAP_S, GroupMeasure,
                                              ServingDataError, ServingRun, parse_manifest,
                                              prefix_columns, read_conversations,
                                              read_manifest, with_conversations)
from jkernel.calibration.fit import serving as fs
from jkernel.errors import Refusal

ROOT = Path(__file__).resolve().parent
EXCERPT = ROOT / "data" / "serving-runs" / "manifest.yaml"
SCENARIO = "qwen3-14b-h100-tp1"


# --------------------------------------------------------------------------------------
# The manifest

def _requests(path: Path, n: int = 20, **extra) -> Path:
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"request_id": np.arange(n), "arrival_time_us": np.arange(n) * 200_000,
                       "input_tokens": rng.integers(100, 300, n),
                       "output_tokens": np.full(n, 16),
                       "ttft_us": np.full(n, 30_000), "e2e_us": np.full(n, 230_000)})
    for k, v in extra.items():
        df[k] = v
    df.to_csv(path, index=False)
    return path


def _doc(**run) -> dict:
    base = {"name": "r1", "deployment": SCENARIO, "requests": "r1.csv", "format": "requests"}
    base.update(run)
    return {"kind": "ServingRuns", "version": 1, "runs": [base]}


def _manifest(tmp_path: Path, doc: dict) -> Path:
    p = tmp_path / "runs.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


def test_a_manifest_reads_per_request_timings_into_group_means(tmp_path):
    _requests(tmp_path / "r1.csv")
    runs = read_manifest(_manifest(tmp_path, _doc()))
    (run,) = runs
    (g,) = run.groups
    assert g.key == -1 and g.requests == 20
    assert g.ttft_mean_s == pytest.approx(0.030) and g.e2e_mean_s == pytest.approx(0.230)
    assert g.itl_mean_s == pytest.approx(0.200 / 15)
    assert run.split == "held-out"          # the only run of its source is held out
    assert len(run.sha256) == 64


def test_inline_group_means_and_the_split_rule(tmp_path):
    _requests(tmp_path / "r1.csv", stage=[0] * 10 + [1] * 10)
    doc = _doc(groups="stage", split="fit", measured=[
        {"group": 0, "requests": 100, "output_tokens": 16, "ttft_mean_ms": 25.0,
         "e2e_mean_ms": 200.0},
        {"group": 1, "requests": 300, "output_tokens": 16, "ttft_mean_ms": 28.0,
         "e2e_mean_ms": 260.0, "label": "busy"}])
    (run,) = read_manifest(_manifest(tmp_path, doc))
    assert [g.requests for g in run.groups] == [100, 300]
    assert run.groups[1].label == "busy" and run.split == "fit"
    assert run.measured_ttft_s is None
    names = [f"run{i}" for i in range(9)]
    held = held_out_runs("s", names)
    assert len(held) == 3 and held == held_out_runs("s", list(reversed(names)))


@pytest.mark.parametrize("change,key", [
    ({"bogus": 1}, "runs[0].bogus"),
    ({"clock": "wall"}, "runs[0].clock"),
    ({"fit_on": ["ttft", "tpot"]}, "runs[0].fit_on[1]"),
    ({"measured": [{"group": -1, "requests": 5, "output_tokens": 16, "ttft_mean_ms": 30,
                    "e2e_mean_ms": 20}]}, "runs[0].measured[0].e2e_mean_ms"),
    ({"measured": [{"group": 3, "requests": 5, "output_tokens": 16, "ttft_mean_ms": 30,
                    "e2e_mean_ms": 200}]}, "runs[0].measured[0].group"),
    ({"groups": "stage"}, "runs[0].groups"),
    ({"requests": "missing.csv"}, "runs[0].requests"),
])
def test_a_bad_manifest_is_refused_naming_the_file_and_the_key(tmp_path, change, key):
    _requests(tmp_path / "r1.csv")
    p = _manifest(tmp_path, _doc(**change))
    with pytest.raises(Refusal) as exc:
        read_manifest(p)
    assert str(p) in str(exc.value) and key in str(exc.value)


def test_a_missing_required_key_and_a_repeated_run_are_refused(tmp_path):
    _requests(tmp_path / "r1.csv")
    doc = _doc()
    del doc["runs"][0]["deployment"]
    with pytest.raises(Refusal, match=r"runs\[0\]\.deployment"):
        read_manifest(_manifest(tmp_path, doc))
    doc = _doc()
    doc["runs"].append(dict(doc["runs"][0]))
    with pytest.raises(Refusal, match=r"runs\[1\]\.name"):
        read_manifest(_manifest(tmp_path, doc))


def test_a_bad_request_row_is_refused_naming_the_file_and_the_row(tmp_path):
    ttft = np.full(20, 30_000.0)
    ttft[7] = -1.0
    path = _requests(tmp_path / "r1.csv")
    df = pd.read_csv(path)
    df["ttft_us"] = ttft
    df.to_csv(path, index=False)
    with pytest.raises(ServingDataError) as exc:
        read_manifest(_manifest(tmp_path, _doc()))
    assert str(path) in str(exc.value) and "row 7" in str(exc.value)
    df["ttft_us"] = 30_000
    df.loc[4, "input_tokens"] = 0
    df.to_csv(path, index=False)
    with pytest.raises(ServingDataError) as exc:
        read_manifest(_manifest(tmp_path, _doc()))
    assert str(path) in str(exc.value) and "4" in str(exc.value)


def _conversations(path: Path, run_ids, convs, warm=((0, 40, 8), (1, 50, 8))) -> Path:
    rows = [{"phase": "warm-up", "request_id": f"w{c}", "conversation": c,
             "input_tokens": n, "output_tokens": o} for c, n, o in warm]
    rows += [{"phase": "run", "request_id": str(i), "conversation": c, "input_tokens": "",
              "output_tokens": ""} for i, c in zip(run_ids, convs)]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_conversations_put_a_warm_up_first_and_every_turn_in_its_conversation(tmp_path):
    _requests(tmp_path / "r1.csv", n=6)
    _conversations(tmp_path / "conv.csv", range(6), [0, 1, 0, 1, 0, 1])
    (run,) = read_manifest(_manifest(tmp_path, _doc(conversations="conv.csv")))
    df = run.requests
    assert df["warm_up"].tolist() == [True, True] + [False] * 6
    assert df["request_id"].astype(str).tolist()[:3] == ["w0", "w1", "0"]
    # the warm-up at the run's spacing (0.2 s), its last send WARM_UP_GAP_S before the run
    arr = df["arrival_s"].to_numpy()
    assert arr[:2] == pytest.approx([0.0, 0.2])
    assert arr[2] - arr[1] == pytest.approx(WARM_UP_GAP_S)
    assert np.diff(arr[2:]) == pytest.approx([0.2] * 5)
    assert df["prefix_group"].tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert (df["prefix_length"] == df["input_tokens"] - CHAT_CLOSE_TOKENS - 1).all()
    # warm-up requests are not measured and no group counts them
    assert np.isnan(run.measured_ttft_s[:2]).all() and np.isfinite(run.measured_ttft_s[2:]).all()
    assert run.group_keys().tolist() == [-2, -2] + [-1] * 6
    (g,) = run.groups
    assert g.requests == 6 and g.ttft_mean_s == pytest.approx(0.030)


def test_a_turn_hits_the_blocks_its_conversations_previous_turn_computed(tmp_path):
    """The replay of a conversation table: the second turn of a conversation finds the
    first turn's prompt (less the chat template's close) in the prefix cache; a request of
    another conversation finds nothing."""
    from jkernel.replay import replay

    df = pd.DataFrame({"request_id": ["0", "1", "2"], "arrival_s": [0.0, 5.0, 10.0],
                       "input_tokens": [200, 400, 300], "output_tokens": [4, 4, 4]})
    conv = pd.read_csv(_conversations(tmp_path / "c.csv", ["0", "1", "2"], [0, 0, 1],
                                      warm=((0, 100, 4),)), dtype={"request_id": str})
    out = replay(jkernel.open(SCENARIO), with_conversations(df, conv)).requests
    cached = dict(zip(out["request_id"].astype(str), out["cached_tokens"]))
    assert cached["w0"] == 0
    assert cached["0"] == (100 - CHAT_CLOSE_TOKENS - 1) // 16 * 16     # the warm-up's turn
    assert cached["1"] == (200 - CHAT_CLOSE_TOKENS - 1) // 16 * 16     # the first run turn
    assert cached["2"] == 0                                            # another conversation


@pytest.mark.parametrize("rows,match", [
    ([{"phase": "later", "request_id": "0", "conversation": 0}], "column 'phase' at row 0"),
    ([{"phase": "run", "request_id": "0", "conversation": 0},
      {"phase": "run", "request_id": "0", "conversation": 1}], "'request_id' at rows 0, 1"),
    ([{"phase": "run", "request_id": "0", "conversation": -1}], "'conversation' at row 0"),
    ([{"phase": "warm-up", "request_id": "w", "conversation": 0, "input_tokens": 0,
       "output_tokens": 3}], "'input_tokens' at row 0"),
])
def test_a_bad_conversation_table_is_refused_naming_the_file_column_and_row(tmp_path, rows,
                                                                            match):
    p = tmp_path / "conv.csv"
    pd.DataFrame(rows).reindex(columns=["phase", "request_id", "conversation",
                                        "input_tokens", "output_tokens"]).to_csv(p, index=False)
    with pytest.raises(ServingDataError, match=match) as exc:
        read_conversations(p)
    assert str(p) in str(exc.value)


def test_a_request_missing_from_the_conversations_and_two_prefix_rules_are_refused(tmp_path):
    _requests(tmp_path / "r1.csv", n=4)
    _conversations(tmp_path / "conv.csv", range(3), [0, 1, 0])
    with pytest.raises(ServingDataError, match=r"requests 3 are not in .*conv\.csv"):
        read_manifest(_manifest(tmp_path, _doc(conversations="conv.csv")))
    with pytest.raises(Refusal, match=r"runs\[0\]\.conversations"):
        read_manifest(_manifest(tmp_path, _doc(conversations="conv.csv", prefix="system")))
    with pytest.raises(Refusal, match=r"runs\[0\]\.conversations"):
        read_manifest(_manifest(tmp_path, _doc(conversations="nowhere.csv")))


def test_the_prompt_rule_makes_repeated_prompts_share_their_blocks():
    df = pd.DataFrame({"input_tokens": [64, 64, 64], "prompt_id": [1, 2, 1],
                       "prefix_group": [0, 0, 0], "shared_prefix_tokens": [32, 32, 32]})
    out = prefix_columns(df, "prompt", 16)
    h = [row.split() for row in out["block_hashes"]]
    assert h[0] == h[2]                  # the same prompt: every block shared
    assert h[0][:2] == h[1][:2]          # the group's system prompt: its two full blocks
    assert h[0][2:] != h[1][2:]
    assert "prefix_group" not in out.columns
    with pytest.raises(ServingDataError, match="prompt_id"):
        prefix_columns(df.drop(columns=["prompt_id"]), "prompt", 16)


# --------------------------------------------------------------------------------------
# The fixed point and the fit

def _synthetic_requests(rate: float, n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"request_id": np.arange(n),
                         "arrival_s": np.cumsum(rng.exponential(1.0 / rate, n)),
                         "input_tokens": rng.integers(300, 900, n),
                         "output_tokens": np.full(n, 48)})


def _run(name: str, df: pd.DataFrame, groups=(GroupMeasure(-1, "all", 1, 48, 0.05, 1.0),)):
    from jkernel.replay import validate_requests

    return ServingRun(name, "synthetic", SCENARIO, validate_requests(df), tuple(groups),
                      split="fit")


def test_the_fixed_point_reproduces_the_replay():
    """At the constants it was replayed with, the fixed-point function gives the replay's
    own group means (to the microsecond ticks of the replay's clock)."""
    jkernel.enable_x64()
    k = jkernel.open(SCENARIO)
    run = _run("a", _synthetic_requests(6.0, 60, 1))
    names = list(fs.SERVING_CONSTANTS)
    theta = np.log([fs._start(k, n) for n in names])
    (seg,) = fs.segments_of(run, sample=0)
    (fp,) = fs._replay_segments([seg], {id(run): k}, names, theta)
    t, e, dt, de = fs._predicted([fp], [run], names, theta, jac=True)[(0, 0)]
    req = fp.result.requests
    assert t == pytest.approx(req["ttft_s"].mean(), abs=2e-6)
    assert e == pytest.approx(req["e2e_s"].mean(), abs=2e-6)
    i = names.index("host_admission_per_request")
    # a request's own admission moves its latency one for one
    assert dt[i] == pytest.approx(math.exp(theta[i]), rel=1e-6)
    assert np.all(np.isfinite(dt)) and np.all(np.isfinite(de))


def test_the_fixed_point_reproduces_a_replay_that_queues_on_the_api_server():
    """With the API server doing work (jkernel.replay.sim), its waits are held like the
    batches: at the replay's constants the fixed point still gives the replay's group means,
    and the waits are in them (the same replay without the work is faster)."""
    jkernel.enable_x64()
    k0 = jkernel.open(SCENARIO)
    k = k0.with_params(k0.params.replace(host_api_server_per_request=4e-3,
                                         host_api_server_per_token=2e-3))
    run = _run("a", _synthetic_requests(20.0, 80, 1))
    names = list(fs.SERVING_CONSTANTS)
    theta = np.log([fs._start(k, n) for n in names])
    (seg,) = fs.segments_of(run, sample=0)
    (fp,) = fs._replay_segments([seg], {id(run): k}, names, theta)
    t, e, _, _ = fs._predicted([fp], [run], names, theta)[(0, 0)]
    req = fp.result.requests
    assert t == pytest.approx(req["ttft_s"].mean(), abs=2e-6)
    assert e == pytest.approx(req["e2e_s"].mean(), abs=2e-6)
    assert fp.result.record.first_wait_us.max() > 0
    (fp0,) = fs._replay_segments([seg], {id(run): k0}, names, theta)
    assert fp0.result.requests["ttft_s"].mean() < t


def test_sampled_groups_count_the_transient_of_the_first_group_only():
    df = _synthetic_requests(20.0, 1000, 2)
    df["stage"] = [0] * 500 + [1] * 500
    groups = (GroupMeasure(0, "s0", 500, 48, 0.05, 1.0), GroupMeasure(1, "s1", 500, 48, 0.05, 1.0))
    run = ServingRun("b", "synthetic", SCENARIO, df, groups, "stage", split="fit")
    s0, s1 = fs.segments_of(run, sample=100, transient_min=100)
    assert len(s0.requests) == len(s1.requests) == 200
    assert np.all(s0.weight[:100] == 1.0) and np.allclose(s0.weight[100:], 400 / 100)
    assert np.all(s1.weight[:100] == 0.0) and np.all(s1.weight[100:] == 1.0)
    assert s1.requests["arrival_s"].iloc[0] == 0.0


def _replayed_runs(kernel, rates, n: int, *, seed: int, noise_seed: int,
                   output_tokens: int = 48) -> list:
    """One fit run per arrival rate: ``n`` synthetic requests (``seed + i`` for the i-th
    rate) replayed on ``kernel``, their mean TTFT and E2E perturbed by 0.5 % noise as the
    run's measured group."""
    from jkernel.replay import replay

    rng = np.random.default_rng(noise_seed)
    runs = []
    for i, rate in enumerate(rates):
        df = _synthetic_requests(rate, n, seed + i).assign(output_tokens=output_tokens)
        res = replay(kernel, df)
        t = res.requests["ttft_s"].mean() * (1 + rng.normal(0, 0.005))
        e = res.requests["e2e_s"].mean() * (1 + rng.normal(0, 0.005))
        runs.append(_run(f"load{rate:g}", df,
                         (GroupMeasure(-1, "all", n, float(output_tokens), t, e),)))
    return runs


def test_the_fit_recovers_known_constants_from_replays_it_generated():
    """Three loads replayed at known constants (a 4 ms front end, 1.1 ms of host time per
    step), their group means perturbed by 0.5 % noise: the fit, started from the catalog,
    finds both inside its 95 % interval; the host time, which every step carries, within
    10 %; the front end, which three loads of 90 requests pin less tightly (its interval
    spans about ±45 %), within 25 %."""
    jkernel.enable_x64()
    k = jkernel.open(SCENARIO)
    truth = {"host_admission_per_request": 4e-3, "host_serial": 1.1e-3}
    runs = _replayed_runs(k.with_params(k.params.replace(**truth)), (2.0, 6.0, 12.0), 90,
                          seed=10, noise_seed=7)
    fit = fs.fit_serving(runs, list(truth), sample=0, max_outer=3,
                         kernels={r.label: k for r in runs}, evaluate_after=False)
    assert set(fit.names) == set(truth)
    for name, v in truth.items():
        rel = 0.10 if name == "host_serial" else 0.25
        assert fit.values[name] == pytest.approx(v, rel=rel), name
        lo, hi = fit.ci95(name)
        assert lo <= v <= hi, (name, lo, hi)
    assert fit.accepted


def test_start_rejected_is_a_likelihood_ratio_test_at_the_groups_scale():
    """2·Δloss against χ²(k) at level 0.95, the loss rescaled from the loss's 3 % to the
    groups' own scatter; no constant put back, no test."""
    ok, stat, crit = fs.start_rejected(10.0, 12.0, 1, fs.SIGMA)
    assert (ok, stat, crit) == (True, pytest.approx(4.0), pytest.approx(3.841, abs=1e-3))
    assert not fs.start_rejected(10.0, 11.5, 1, fs.SIGMA)[0]          # 3.0 < 3.84
    ok, stat, _ = fs.start_rejected(10.0, 12.0, 1, 2 * fs.SIGMA)      # twice the scatter
    assert not ok and stat == pytest.approx(1.0)
    assert fs.start_rejected(10.0, 12.0, 1, 0.5 * fs.SIGMA)[1] == pytest.approx(4.0)
    assert fs.start_rejected(10.0, 14.0, 2, fs.SIGMA)[0]              # 8.0 > 5.99
    ok, stat, crit = fs.start_rejected(10.0, 12.5, 2, fs.SIGMA)       # 5.0 < 5.99
    assert not ok and crit == pytest.approx(5.991, abs=1e-3)
    assert fs.start_rejected(10.0, 50.0, 0, fs.SIGMA) == (False, 0.0, math.inf)


def test_a_borrowed_start_the_groups_reject_does_not_survive_the_fit():
    """The per-request host time started 15 × above the truth it was replayed with (a
    value borrowed from another engine version): three loads pin it only loosely, yet the
    fit does not put it back to that start, since the groups rule the start out
    (the defect: a constant left unpinned went back to a borrowed 36 µs that queued the
    replay of a 20 req/s run its own engine served)."""
    jkernel.enable_x64()
    k = jkernel.open(SCENARIO)
    truth = {"host_serial": 0.8e-3, "host_serial_per_request": 4e-6}
    runs = _replayed_runs(k.with_params(k.params.replace(**truth)), (4.0, 16.0, 40.0), 120,
                          seed=20, noise_seed=11, output_tokens=160)
    start = {"host_serial_per_request": 60e-6}
    fit = fs.fit_serving(runs, list(truth), sample=0, max_outer=4, start=start,
                         kernels={r.label: k for r in runs}, evaluate_after=False)
    assert fit.start["host_serial_per_request"] == 60e-6
    psr = fit.values["host_serial_per_request"]
    assert abs(math.log(psr / 4e-6)) < abs(math.log(60e-6 / psr)), psr
    assert "host_serial_per_request" in fit.names
    # the per-step host time trades against it along the loads' common direction
    assert fit.values["host_serial"] == pytest.approx(0.8e-3, rel=0.35)
    # these loads bound it loosely (not pinned), but they rule its start out
    assert not fit.laplace.identifiable["host_serial_per_request"]
    assert "reject its start" in fit.loose["host_serial_per_request"]
    assert "not pinned but kept" in fit.verdict()
    with pytest.raises(ValueError, match="positive value"):
        fs.fit_serving(runs, list(truth), start={"host_serial": 0.0}, evaluate_after=False)


def test_fit_classes_goes_newest_first_and_starts_older_versions_from_the_newer_fit(
        monkeypatch):
    """Per chip, the newest engine version is fitted first, and an older class starts from
    the step constants that fit took (what it borrows once they are written), never from
    front-end constants; a class with held-out runs only is not fitted."""
    from types import SimpleNamespace

    df = _synthetic_requests(2.0, 10, 1)
    new = _run("new", df)
    old = ServingRun("old", "synthetic", str(ROOT.parent / "validation" / "scenarios" /
                                             "mistral-nemo-h100-tp1-vllm0.15.yaml"),
                     new.requests, new.groups, split="fit")
    held = ServingRun("held", "synthetic", str(ROOT.parent / "validation" / "scenarios" /
                                               "llama-4-scout-fp8-h100-tp4-vllm0.8.5.yaml"),
                      new.requests, new.groups, split="held-out")
    calls = []

    def fake(fit_runs, names, *, start=None, **kw):
        calls.append((fit_runs[0].label, names, start))
        values = {"host_serial": 1e-3, "host_serial_per_request": 5e-6,
                  "host_admission_per_request": 4e-3}
        return SimpleNamespace(cls=fs.class_of(kw["kernels"][fit_runs[0].label]),
                               values=values, taken=lambda: tuple(values),
                               verdict=lambda: "taken")

    monkeypatch.setattr(fs, "fit_serving", fake)
    said = []
    fits = fs.fit_classes([old, held, new], names_for=lambda cls, runs: ("host_serial",),
                          log=said.append)
    assert [c[0] for c in calls] == ["synthetic/new", "synthetic/old"]   # 0.23.0, 0.15.1
    assert calls[0][2] is None
    assert calls[1][2] == {"host_serial": 1e-3, "host_serial_per_request": 5e-6}
    assert calls[1][1] == ("host_serial",)
    assert len(fits) == 2 and any("held-out runs only" in m for m in said)


def test_fit_serving_refuses_runs_of_two_classes_and_unknown_constants():
    a = _run("a", _synthetic_requests(2.0, 10, 1))
    with pytest.raises(ValueError, match="not a serving constant"):
        fs.fit_serving([a], ["hbm_derate"], evaluate_after=False)
    b = ServingRun("b", "synthetic", str(ROOT.parent / "validation" / "scenarios" /
                                         "mistral-nemo-h100-tp1-vllm0.15.yaml"),
                   a.requests, a.groups, split="fit")
    with pytest.raises(ValueError, match="one deployment class"):
        fs.fit_serving([a, b], evaluate_after=False)


def test_version_ranges_split_at_the_engine_boundaries():
    r = fs.version_ranges(["0.23.0", "0.8.5", "0.15.1"], fs.FRONT_END_BOUNDARIES)
    assert (r["0.8.5"].first, r["0.8.5"].before) == (fs.OLDEST, "0.10.0")
    assert (r["0.15.1"].first, r["0.15.1"].before) == ("0.10.0", "0.23.0")
    assert (r["0.23.0"].first, r["0.23.0"].before) == ("0.23.0", None)
    (only,) = fs.version_ranges(["0.19.0"], fs.STEP_BOUNDARIES).values()
    assert only.contains("0.8.0") and only.contains("0.31.0")


def test_family_of_cuts_the_name_at_the_parameter_count():
    assert fs.family_of("llama-3.1-70b-instruct") == "llama-3.1"
    assert fs.family_of("qwen2.5-7b-instruct") == "qwen2.5"
    assert fs.family_of("yi-34b") == "yi"
    assert fs.family_of("mistral-nemo-instruct-2407") == "mistral-nemo"


# --------------------------------------------------------------------------------------
# The command on the committed excerpt (a fresh clone has no ../shared)

def test_the_command_runs_on_the_committed_excerpt(tmp_path):
    from jkernel.calibration.__main__ import main
    from jkernel.documents.coefficients import load_coefficient_set

    out = tmp_path / "serving.yaml"
    table = tmp_path / "groups.csv"
    rc = main(["serving", "--runs", str(EXCERPT), "--out", str(out), "--max-outer", "1",
               "--table", str(table), "--write-all", "--quiet"])
    assert rc == 0
    cs = load_coefficient_set(out)
    assert cs.entries
    for e in cs.entries:
        assert e.method == "fitted" and e.fitted_on is not None
        assert e.scope.engine_version is not None
        assert dict(e.extra)["data_sha256"]
    report = out.with_suffix(".md").read_text()
    assert "# Serving calibration" in report and "held-out" in report
    t = pd.read_csv(table)
    assert set(t["split"]) == {"fit"}
    assert {"ttft_mean_error_before", "itl_mean_error_after"} <= set(t.columns)


def test_the_command_fits_the_api_server_on_the_committed_excerpt(tmp_path):
    """``--api-server`` writes the API server's two constants for the class it fitted,
    scoped to its engine versions and every chip given, with the verdict in the rationale:
    one load point is one group, too few to fit the work (MIN_GROUPS), so both are 0."""
    from jkernel.calibration.__main__ import main
    from jkernel.documents.coefficients import load_coefficient_set

    out = tmp_path / "serving.yaml"
    rc = main(["serving", "--runs", str(EXCERPT), "--out", str(out), "--max-outer", "1",
               "--only", "4 req/s", "--api-server", "--front-end-hardware", "h100", "h200",
               "--quiet"])
    assert rc == 0
    api = {e.name: e for e in load_coefficient_set(out).entries
           if e.name.startswith("host_api_server_")}
    assert set(api) == {"host_api_server_per_request", "host_api_server_per_token"}
    for e in api.values():
        assert e.method == "not_charged" and e.scope.hardware == ("h100", "h200")
        assert e.scope.engine_version is not None and e.fitted_on is not None
        assert e.value == 0.0 and "too few to fit the work" in e.rationale


def test_the_command_refuses_a_bad_manifest_with_status_2(tmp_path, capsys):
    from jkernel.calibration.__main__ import main

    p = tmp_path / "m.yaml"
    p.write_text("kind: ServingRuns\nversion: 2\nruns: []\n")
    assert main(["serving", "--runs", str(p), "--out", str(tmp_path / "o.yaml")]) == 2
    assert "version" in capsys.readouterr().err


def test_parse_manifest_anchors_relative_paths_at_the_given_root(tmp_path):
    (tmp_path / "data").mkdir()
    _requests(tmp_path / "data" / "r1.csv")
    doc = _doc()
    (run,) = parse_manifest(doc, file=str(tmp_path / "m.yaml"), root=tmp_path / "data")
    assert run.requests.attrs["source"].endswith("r1.csv")


def test_merging_version_scoped_entries_keeps_disjoint_versions_side_by_side():
    """The regeneration's replacement rule: a new entry for a chip and a version range
    takes the chip from an unversioned entry of the same name for those versions only (the
    old entry keeps the versions outside them), and entries of one name and chip for
    disjoint versions live side by side."""
    from jkernel.calibration.regenerate import merge_entries
    from jkernel.documents.coefficients import Entry, Scope, VersionRange

    def e(value, hw, ev=None):
        return Entry("host_admission_per_request", value, "us_per_request",
                     "fitted" if value else "not_charged", bool(value),
                     Scope(hardware=hw, engine_version=ev), rationale="r")

    old = [e(0.0, ("a100-sxm", "h100"))]
    new = [e(5000.0, ("a100-sxm", "h100"), VersionRange("0.10.0", "0.23.0")),
           e(6800.0, ("a100-sxm", "h100"), VersionRange("0.23.0"))]
    out = merge_entries(old, new)
    assert [(x.value, x.scope.engine_version) for x in out] == [
        (5000.0, VersionRange("0.10.0", "0.23.0")), (0.0, VersionRange("0.8.0", "0.10.0")),
        (6800.0, VersionRange("0.23.0"))]
    again = merge_entries(out, [e(7000.0, ("h100",), VersionRange("0.23.0"))])
    kept = {(x.value, x.scope.hardware) for x in again}
    assert kept == {(5000.0, ("a100-sxm", "h100")), (0.0, ("a100-sxm", "h100")),
                    (6800.0, ("a100-sxm",)), (7000.0, ("h100",))}


def test_a_serving_fit_of_older_versions_keeps_the_step_trace_fit_for_its_own():
    """Step constants a serving fit takes at vLLM 0.15.1 on a chip whose 0.23.0 steps were
    step-traced are scoped below 0.23.0; the step-trace entry (unversioned) keeps 0.23.0 on.
    (Defect: the serving fit's entry, open above, replaced the step-trace fit for every
    version, so the deployment the step constants were measured on lost them.)"""
    from jkernel.calibration.fit.serving import DeploymentClass
    from jkernel.calibration.regenerate import merge_entries
    from jkernel.calibration.report.coefficients import serving_set
    from jkernel.documents.coefficients import Entry, Scope, VersionRange

    class Fit:                          # the part of a ServingFit that serving_set reads
        cls = DeploymentClass("h100", "0.15.1")
        names = ("host_serial",)
        runs = ()
        accepted = True

        def taken(self):
            return self.names

    import jkernel.calibration.report.coefficients as C
    seen = {}
    real = C.serving_entries
    C.serving_entries = lambda fit, **kw: seen.update(kw) or []
    try:
        serving_set([Fit()], command="c", step_traced=[DeploymentClass("h100", "0.23.0")])
    finally:
        C.serving_entries = real
    rng = seen["engine_versions"]["host_serial"]
    assert rng == VersionRange("0.8.0", "0.23.0")
    traced = Entry("host_serial", 806.6, "us", "fitted", True, Scope(hardware=("h100",)),
                   rationale="step traces")
    served = Entry("host_serial", 418.4, "us", "fitted", True,
                   Scope(hardware=("h100",), engine_version=rng), rationale="serving runs")
    out = merge_entries([traced], [served])
    assert [(x.value, x.scope.engine_version) for x in out] == [
        (418.4, VersionRange("0.8.0", "0.23.0")), (806.6, VersionRange("0.23.0"))]


def test_only_step_traced_constants_make_a_class_fit_its_front_end_alone():
    """Guards a defect: the serving stage took the step constants an earlier serving fit had
    written (fitted, on runs the deployment is inside) for step-trace fits, and on its next
    run fitted that class's front end alone, so regenerating twice changed the catalog."""
    from jkernel.calibration.regenerate import front_end_only

    assert front_end_only(jkernel.open(SCENARIO))          # vLLM 0.23: the step traces'
    bundle = ROOT.parent / "validation" / "scenarios" / "llama-2-7b-h100-tp1-vllm0.15.yaml"
    k = jkernel.open(str(bundle))
    prov = {p.name: p for p in k.provenance()}
    assert prov["host_serial"].method == "fitted" and not prov["host_serial"].outside
    assert not front_end_only(k)                           # vLLM 0.15.1: a serving fit's


def test_the_front_end_is_written_for_every_chip_the_catalog_prices_one_for(tmp_path):
    """Guards a defect: the serving stage found the chips from an entry without an
    engine-version scope; once every front-end entry was version-scoped it found none and
    wrote the fitted chip alone, so the other chips kept an older fit's front end."""
    from jkernel.calibration.regenerate import front_end_chips

    host = tmp_path / "coefficients" / "cost-model-host-overheads.yaml"
    host.parent.mkdir(parents=True)

    def entry(value, hardware):
        return {"host_admission_per_request": {
            "value": value, "units": "us_per_request", "method": "fitted", "fitted": True,
            "scope": {"hardware": hardware, "engine_version": {"from": "0.10.0"}}}}

    host.write_text(yaml.safe_dump({"kind": "CoefficientSet", "name": "cost-model-host-overheads",
                                    "coefficients": [entry(5000.0, ["a100-80", "l40s"]),
                                                     entry(6000.0, ["h100"])]}))
    assert front_end_chips(tmp_path) == ("a100-80", "l40s", "h100")
    assert front_end_chips(tmp_path / "nowhere") is None
