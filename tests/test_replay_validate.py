"""The validation compares like with like: client TTFT/E2E from send time, ITL as the runs'
summary.json pools chunk gaps (role chunk and final chunk included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from validation import replay as V
from jkernel.replay.api import ReplayResult

DATA = Path(__file__).resolve().parent / "data" / "residency-vllm"


def test_measured_summary_of_a_hand_built_trace():
    trace = pd.DataFrame({"send_time_us": [0, 1_000_000], "first_chunk_time_us": [50_000, 1_070_000],
                          "last_chunk_time_us": [1_050_000, 2_270_000], "num_chunks": [5, 5],
                          "status": ["ok", "ok"]})
    m = V.measured_summary(trace, {"overall": {"itl_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}}})
    assert m["ttft_mean"] == pytest.approx(0.06)
    assert m["e2e_mean"] == pytest.approx((1.05 + 1.27) / 2)
    assert m["itl_mean"] == pytest.approx((1.0 + 1.2) / 8)        # Σ(last − first) / Σ(chunks − 1)
    assert m["itl_p90"] == 0.002


def test_failed_requests_are_left_out_of_the_measured_side():
    trace = pd.DataFrame({"send_time_us": [0, 0], "first_chunk_time_us": [10, 10**6],
                          "last_chunk_time_us": [20, 2 * 10**6], "num_chunks": [3, 3],
                          "status": ["ok", "error"]})
    assert V.measured_summary(trace)["requests"] == 1


def test_predicted_itl_counts_the_two_extra_chunks():
    req = pd.DataFrame({"ttft_s": [0.1], "e2e_s": [1.1], "output_tokens": [4],
                        "rejected": [False]})
    res = ReplayResult(req, {}, itl_gaps_s=np.array([0.3, 0.3, 0.3]))
    p = V.predicted_summary(res)
    assert p["itl_mean"] == pytest.approx(1.0 / 5)                # 6 chunks, 5 gaps
    assert p["itl_p50"] == pytest.approx(0.3)                     # pooled with two 0 gaps
    assert p["itl_p99"] == pytest.approx(0.3)


def test_committed_run_summaries_cover_the_five_runs():
    runs = pd.read_csv(DATA / "runs.csv")
    assert list(runs.run) == [r[0] for r in V.RUNS]
    assert runs.requests.tolist() == [1212, 1181, 2363, 3610, 4830]
    # The 2 requests/s run's ITL mean matches its summary.json (12.21 ms).
    assert runs.itl_mean[0] * 1e3 == pytest.approx(12.21, abs=0.005)
    assert (runs.rate_per_s.round() == [2, 2, 4, 6, 8]).all()


def test_validate_on_the_excerpt_runs_end_to_end(tmp_path):
    folder = tmp_path / V.RUNS[0][1]
    folder.mkdir(parents=True)
    pd.read_csv(DATA / "agg_2rps_head.csv").head(20).to_csv(folder / "trace.csv", index=False)
    table = V.validate(tmp_path, runs=["2rps"])
    assert len(table) == 1 and table.requests[0] == 20
    for key in ("ttft_mean", "itl_mean", "e2e_mean"):
        assert np.isfinite(table[f"{key}_error"][0])
    assert "ttft_mean" in V.format_table(table)


def test_main_refuses_a_missing_folder(tmp_path, capsys):
    assert V.main([str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err


def _excerpt_root(tmp_path, n=20):
    folder = tmp_path / V.RUNS[0][1]
    folder.mkdir(parents=True)
    pd.read_csv(DATA / "agg_2rps_head.csv").head(n).to_csv(folder / "trace.csv", index=False)
    return tmp_path


def test_profile_only_constants_are_what_a_chip_has_without_a_step_trace():
    """`--constants profiles` prices with the step constants of a chip no step trace fitted:
    the calibration's starting point, and what a kernel on such a chip (h200) reads."""
    import jkernel
    from jkernel.calibration.fit.stepfit import PROFILE_ONLY

    assert V.PROFILE_ONLY == PROFILE_ONLY
    k = jkernel.open("llama-3.1-70b-instruct-h200-fp8-tp8")
    for name, value in V.PROFILE_ONLY.items():
        assert k.params.value(name) == value and k.assumption(name) is not None
    shipped = V._kernel(V.SCENARIO)
    assert shipped.params.value("compute_derate") < 1.0      # the H100 step-trace fit
    profiles = V._kernel(V.SCENARIO, "profiles")
    assert {n: profiles.params.value(n) for n in V.PROFILE_ONLY} == V.PROFILE_ONLY
    with pytest.raises(ValueError, match="shipped"):
        V._kernel(V.SCENARIO, "seed")


def test_profile_only_constants_price_the_excerpt_faster(tmp_path):
    """Without the unhidden host time and the compute derate every step is shorter, so the
    replay's TTFT, ITL and E2E all drop; the table records which constants priced it."""
    root = _excerpt_root(tmp_path)
    shipped = V.validate(root, runs=["2rps"])
    profiles = V.validate(root, runs=["2rps"], constants="profiles")
    assert shipped.attrs["constants"] == "shipped" and profiles.attrs["constants"] == "profiles"
    for key in ("ttft_mean", "itl_mean", "e2e_mean"):
        assert profiles[f"{key}_predicted_s"][0] < shipped[f"{key}_predicted_s"][0]
        assert profiles[f"{key}_measured_s"][0] == shipped[f"{key}_measured_s"][0]
    assert shipped.attrs["admission_overhead_s"] > 0


def test_markdown_table_of_two_constant_sets(tmp_path):
    """Each cell is the error of the mean with the p90's in brackets, in per cent with a
    true minus sign; a missing measured p90 (no summary.json) reads n/a, not nan."""
    table = pd.DataFrame([{"run": "2rps", **{f"{m}_{s}": v for m in ("ttft", "itl", "e2e")
                                             for s, v in (("mean_error", -0.1234),
                                                          ("p90_error", 0.0049))},
                           "ttft_mean_measured_s": 0.066, "ttft_mean_predicted_s": 0.059}])
    a, b = table.copy(), table.copy()
    a.attrs = {"constants": "profiles"}
    b.attrs = {"constants": "shipped", "admission_overhead_s": 3.5e-4, "mean_prompt_tokens": 1000}
    b["itl_p90_error"] = float("nan")
    md = V.markdown_table(a, b).splitlines()
    assert md[0] == "| run | TTFT | ITL | E2E | TTFT | ITL | E2E |"
    assert "*profile-only step constants*" in md[2] and "*shipped constants" in md[2]
    assert md[3] == ("| 2 req/s | \u221212.3 % (+0.5) | \u221212.3 % (+0.5) | \u221212.3 % (+0.5) "
                     "| \u221212.3 % (+0.5) | \u221212.3 % (n/a) | \u221212.3 % (+0.5) |")
    assert "7.0 to 7.0 ms short" in md[-1] and "0.35 ms" in md[-1] and "1,000-token" in md[-1]
    with pytest.raises(ValueError):
        V.markdown_table()


def test_main_markdown_with_both_constant_sets(tmp_path, capsys):
    root = _excerpt_root(tmp_path, n=10)
    csv = tmp_path / "t.csv"
    assert V.main([str(root), "--runs", "2rps", "--constants", "both", "--markdown",
                   "--csv", str(csv)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| run |") and "| 2 req/s |" in out
    assert (tmp_path / "t-profiles.csv").exists() and (tmp_path / "t-shipped.csv").exists()
