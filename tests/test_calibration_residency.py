"""The residency importer (jkernel.calibration.data.residency): chunks → tokens → steps.

Synthetic runs are written as the client writes them (trace.csv + trace.itl.csv, µs on one
clock) from a known step schedule; the excerpt is tests/data/residency (see its README).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from jkernel.calibration.data.residency import find_run, import_residency
from jkernel.calibration.data.traces import TraceError, read_trace

EXCERPT = Path(__file__).parent / "data" / "residency" / "agg_2rps"
STEP_US = 10_000.0          # every synthetic step lasts 10 ms
T0 = 1_000_000_000.0


def write_run(path: Path, requests, *, jitter_us: float = 30.0):
    """``requests``: dicts with ``send_step`` (sent just after that step's end; −1 before
    the first), ``prompt``, ``first`` (step of its first token), ``tokens``, optional
    ``chunks`` (list: tokens carried by each token chunk, default one each), ``status``,
    ``skip`` (steps in which it emits nothing although running)."""
    path.mkdir(parents=True, exist_ok=True)
    rows, chunks = [], []
    for rid, r in enumerate(requests):
        end = lambda k: T0 + STEP_US * (k + 1) + jitter_us * (rid % 3)  # noqa: E731
        per = r.get("chunks", [1] * r["tokens"])
        assert sum(per) == r["tokens"]
        times, step = [], r["first"]
        for i, n in enumerate(per):
            step += (n - 1) if i else 0
            while step in r.get("skip", ()):
                step += 1
            times.append(end(step))
            step += 1
        ts = [times[0] - 20.0] + times + [times[-1] + 10.0]      # role chunk, final chunk
        send = T0 + STEP_US * (r["send_step"] + 1) + 1.0
        rows.append({"request_id": rid, "server_input_tokens": r["prompt"],
                     "output_tokens": r["tokens"], "send_time_us": send,
                     "first_chunk_time_us": ts[0], "last_chunk_time_us": ts[-1],
                     "num_chunks": len(ts), "status": r.get("status", "ok")})
        chunks += [{"request_id": rid, "chunk_index": i, "timestamp_us": t}
                   for i, t in enumerate(ts)]
    pd.DataFrame(rows).to_csv(path / "trace.csv", index=False)
    pd.DataFrame(chunks).to_csv(path / "trace.itl.csv", index=False)
    return path


def by_end(rec):
    """Steps keyed by their step number (end time → k)."""
    return {int(round((s["end_s"] * 1e6 + (T0 - T0)) / STEP_US)): s for s in rec.steps}


def compose(step):
    return sorted(zip(step["requests"], step["scheduled"], step["computed"]))


def test_role_and_final_chunks_are_not_tokens(tmp_path):
    """Two overlapping requests, 130-chunk style: the role chunk (just before the first
    token) and the final empty chunk are set aside, so every step has one token per running
    request and decodes sit at computed = prompt + j − 1."""
    run = write_run(tmp_path / "r", [
        {"send_step": -1, "prompt": 100, "first": 0, "tokens": 5},
        {"send_step": 1, "prompt": 50, "first": 2, "tokens": 4}])
    rec = import_residency(run, max_num_batched_tokens=8192)
    assert rec.dropped == {}
    assert len(rec.steps) == 6 and rec.coalesced_chunks == 0
    s = rec.steps
    assert compose(s[0]) == [(0, 100, 0)]
    assert compose(s[2]) == [(0, 1, 101), (1, 50, 0)]
    assert compose(s[4]) == [(0, 1, 103), (1, 1, 51)]
    assert compose(s[5]) == [(1, 1, 52)]
    # durations: end − previous end (10 ms ± the per-request jitter of the first chunk)
    for st in s[1:]:
        assert st["duration_s"] == pytest.approx(STEP_US * 1e-6, abs=1e-4)
    assert "idle_before" in s[0]["flags"]
    assert not any("idle_before" in st["flags"] for st in s[1:])


def test_without_stripping_the_role_chunk_would_count_a_phantom_token(tmp_path):
    """Guards the role-chunk rule: read as a token, the role chunk makes one chunk more than
    the request has tokens, which the importer refuses to compose (counted)."""
    run = write_run(tmp_path / "r", [{"send_step": -1, "prompt": 10, "first": 0, "tokens": 4}])
    with pytest.raises(TraceError, match="request_more_chunks_than_tokens"):
        import_residency(run, role_chunk=False)
    assert import_residency(run).dropped == {}


def test_several_tokens_in_one_chunk(tmp_path):
    """A chunk carrying two tokens (the stream fell behind): the request ran a decode in the
    step where it sent nothing, which the other request's chunks mark."""
    run = write_run(tmp_path / "r", [
        {"send_step": -1, "prompt": 20, "first": 0, "tokens": 6},
        {"send_step": -1, "prompt": 30, "first": 0, "tokens": 5, "chunks": [1, 1, 2, 1]}])
    rec = import_residency(run)
    assert rec.dropped == {}
    assert rec.coalesced_chunks == 1
    assert len(rec.steps) == 6
    for j, st in enumerate(rec.steps[1:5], start=1):        # request 1 decodes in 1…4
        assert (1, 1, 30 + j - 1) in compose(st)
    assert compose(rec.steps[5]) == [(0, 1, 24)]


def test_chunked_prefill_over_the_token_budget(tmp_path):
    """A 10,000-token prompt sent during step 1, with a budget of 8,192 while another
    request decodes: vLLM V1 schedules it from step 2, runs 8,191 tokens there (one token of
    the budget goes to the decode) and the rest in step 3, which emits its first token."""
    run = write_run(tmp_path / "r", [
        {"send_step": -1, "prompt": 100, "first": 0, "tokens": 6},
        {"send_step": 0, "prompt": 10_000, "first": 3, "tokens": 2}])
    rec = import_residency(run, max_num_batched_tokens=8192)
    assert rec.chunked_prefills == 1 and rec.dropped == {}
    assert compose(rec.steps[2]) == [(0, 1, 101), (1, 8191, 0)]
    assert compose(rec.steps[3]) == [(0, 1, 102), (1, 1809, 8191)]
    assert compose(rec.steps[4]) == [(0, 1, 103), (1, 1, 10_000)]


def test_chunked_prefill_alone_is_invisible_and_dropped(tmp_path):
    """With nothing else running, the first chunk's step emits no chunk at all: its time is
    inside the first token's step, which cannot be priced as one step (dropped, counted)."""
    run = write_run(tmp_path / "r", [
        {"send_step": -1, "prompt": 20_000, "first": 2, "tokens": 3}])
    rec = import_residency(run, max_num_batched_tokens=8192)
    assert rec.dropped == {"prefill_chunks_hidden": 1}
    assert [compose(s) for s in rec.steps] == [[(0, 1, 20_000)], [(0, 1, 20_001)]]


def test_paused_request_and_failed_request_are_counted(tmp_path):
    """A request that emits nothing for a step while others run (preemption) spans more steps
    than tokens: its steps are dropped; a failed request is dropped as a request."""
    run = write_run(tmp_path / "r", [
        {"send_step": -1, "prompt": 10, "first": 0, "tokens": 6},
        {"send_step": -1, "prompt": 10, "first": 0, "tokens": 3, "skip": (2,)},
        {"send_step": -1, "prompt": 10, "first": 0, "tokens": 3, "status": "error"}])
    rec = import_residency(run)
    assert rec.dropped["request_status_error"] == 1
    assert rec.dropped["request_inconsistent"] == 1
    assert rec.dropped["inconsistent_request"] == 4          # steps 0…3 of request 1
    assert [compose(s) for s in rec.steps] == [[(0, 1, 13)], [(0, 1, 14)]]   # j = 4, 5


def test_bad_input_names_the_file(tmp_path):
    run = write_run(tmp_path / "r", [{"send_step": -1, "prompt": 10, "first": 0, "tokens": 2}])
    df = pd.read_csv(run / "trace.csv").drop(columns=["num_chunks"])
    df.to_csv(run / "trace.csv", index=False)
    with pytest.raises(TraceError, match="trace.csv.*num_chunks"):
        import_residency(run)
    with pytest.raises(TraceError, match="no trace.csv"):
        find_run(tmp_path / "nowhere")


def test_excerpt_rebuilds_every_token():
    """The committed excerpt (300 requests of the residency-vllm 2 req/s run): nothing
    dropped, each request's 128 tokens are one prefill and 127 decodes in consecutive steps,
    and decode steps last about what the run's inter-token latency says (11–13 ms)."""
    rec = import_residency(EXCERPT)
    assert rec.requests == 300 and rec.dropped == {}
    assert rec.token_chunks == 300 * 128
    per_req: dict = {}
    for st in rec.steps:
        for r, s, c in zip(st["requests"], st["scheduled"], st["computed"]):
            per_req.setdefault(r, []).append((s, c))
    assert len(per_req) == 300
    for r, rows in per_req.items():
        assert len(rows) == 128
        p = rows[0][0]
        assert rows[0][1] == 0 and 900 < p < 1100
        assert [c for _, c in rows[1:]] == list(range(p, p + 127))
    dec = [s["duration_s"] for s in rec.steps
           if max(s["scheduled"]) == 1 and "idle_before" not in s["flags"]]
    assert 0.011 < float(np.median(dec)) < 0.013
    ends = [s["end_s"] for s in rec.steps]
    assert ends == sorted(ends)


def test_cli_import_residency_writes_a_trace(tmp_path):
    out = tmp_path / "steps.jsonl"
    r = subprocess.run([sys.executable, "-m", "jkernel.calibration", "import", "residency",
                        str(EXCERPT), "--out", str(out)], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr
    assert "300 requests" in r.stderr and "dropped: nothing" in r.stderr
    tr = read_trace(out)
    assert tr.deployment == "qwen3-14b-h100-tp1"
    assert tr.end_s is not None and np.all(np.diff(tr.end_s) >= 0)
    rec = import_residency(EXCERPT)
    assert len(tr) == len(rec.steps)


def test_cli_traces_time_split_and_held_out_run(tmp_path):
    """`traces --split time --held-trace`: fits the step constants on the first 70 % of the
    excerpt's steps, writes them as fitted h100 entries, and reports the errors of another
    trace (here the excerpt's own last third, written as a separate file) before and after."""
    from jkernel.calibration.data.traces import write_trace
    rec = import_residency(EXCERPT)
    steps = tmp_path / "steps.jsonl"
    write_trace(steps, rec.trace)
    tail = rec.trace.select(np.arange(len(rec.trace)) >= 2 * len(rec.trace) // 3)
    held = tmp_path / "held.jsonl"
    write_trace(held, tail)
    out, csv = tmp_path / "fit.yaml", tmp_path / "held.csv"
    r = subprocess.run([sys.executable, "-m", "jkernel.calibration", "traces", "--traces",
                        str(steps),
                        "--split", "time", "--heldout", "0.3", "--steps", "150",
                        "--fit", "host_serial,host_serial_per_request,compute_derate",
                        "--exclude-flags", "idle_before", "--held-trace", str(held),
                        "--report-csv", str(csv), "--out", str(out)],
                       capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr
    from jkernel.documents.coefficients import load_coefficient_set
    cs = load_coefficient_set(out)
    got = {e.name: e for e in cs.entries}
    assert set(got) == {"host_serial", "host_serial_per_request", "compute_derate"}
    assert got["host_serial_per_request"].units == "us_per_request"
    assert 300 < got["host_serial"].value < 1500            # µs per step
    table = pd.read_csv(csv)
    assert set(table.kind) == {"decode", "prefill"}
    assert "held-out run" in r.stderr and "(fitted)" in r.stderr
