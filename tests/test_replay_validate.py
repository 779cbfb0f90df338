"""The validation compares like with like: client TTFT/E2E from send time, ITL as the runs'
summary.json pools chunk gaps (role chunk and final chunk included)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from jkernel.replay import validate as V
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
