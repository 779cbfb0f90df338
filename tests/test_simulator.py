"""The example simulator is a thin user of :mod:`jkernel.replay`: its workload is seeded, it
reads every pool setting from the kernels and dispatches to the right replay.

The scheduler's own rules are tested in ``test_replay_scheduler.py`` and ``test_replay.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conftest import bundle_with as _bundle_with  # noqa: E402
from examples import simulator as S  # noqa: E402

SMALL = ROOT / "catalog" / "scenarios" / "llama-3.1-8b-h100-tp1.yaml"


def bundle_with(tmp_path: Path, source: Path = SMALL, **engine) -> Path:
    return _bundle_with(tmp_path, source, **engine)


def test_workload_is_seeded_and_sorted():
    w1 = S.poisson_workload(50, 10.0, seed=3)
    w2 = S.poisson_workload(50, 10.0, seed=3)
    w3 = S.poisson_workload(50, 10.0, seed=4)
    assert w1.equals(w2) and not w1.equals(w3)
    assert w1.arrival_s.iloc[0] == 0 and w1.arrival_s.is_monotonic_increasing
    assert list(w1.columns) == ["request_id", "arrival_s", "input_tokens", "output_tokens"]
    assert (w1.input_tokens >= 2).all()


def test_pool_table_reads_the_kernels(tmp_path):
    for block in (16, 32):
        b = bundle_with(tmp_path, block_size=block, max_num_seqs=64)
        row = S.pool_table(b).iloc[0]
        (k,) = S.kernels(b)
        assert row.block_size == k.settings.block_size == block
        assert row.max_num_seqs == 64 and row.kv_pages == k.kv_cache_pages()
    pools = S.pool_table(S.DISAGG_BUNDLE)
    assert list(pools.pool) == ["prefill", "decode"]
    assert list(pools.engines) == [2, 1] and list(pools.tp) == [4, 8]


def test_run_dispatches_colocated_and_disaggregated():
    reqs = S.poisson_workload(30, 4.0, prompt_mean=512, output_mean=16, seed=1)
    col = S.run(SMALL, reqs)
    assert set(col.steps.pool) == {"colocated"} and col.summary["completed"] == 30
    dis = S.run(S.DISAGG_BUNDLE, reqs)
    assert set(dis.steps.pool) == {"prefill", "decode"} and dis.summary["completed"] == 30
    table = S.summary_table({"colocated": col, "disaggregated": dis})
    assert table.loc["completed"].tolist() == [30, 30]


@pytest.mark.parametrize("clock", ["expected_s", "no_overlap_s"])
def test_clock_choice_reaches_the_replay(clock):
    reqs = S.poisson_workload(5, 2.0, prompt_mean=2000, output_mean=4, seed=0)
    res = S.run(SMALL, reqs, clock=clock)
    (k,) = S.kernels(SMALL)
    import jkernel

    first = res.steps.iloc[0]
    p = int(reqs.input_tokens.iloc[0])
    want = getattr(k.step_time(jkernel.Batch([p], [0])), clock)
    assert first.duration_s == pytest.approx(want, abs=1e-6)
    assert np.isfinite(res.summary["e2e_mean_s"])
