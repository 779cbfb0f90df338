"""The interval studies of validation/ on committed data (a fresh clone has no ../shared):
the shipped error model's systematic spreads and front end are what the committed group
residuals give, and the coverage tables are what the committed cells give."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from jkernel.uncertainty.errormodel import CLASSES, shipped_error_model
from jkernel.uncertainty.estimate import GroupResidual, front_end, systematic
from jkernel.uncertainty.intervals import interval

from conftest import ROOT

DATA = ROOT / "tests" / "data" / "intervals"


def _groups(table: pd.DataFrame) -> list[GroupResidual]:
    use = table[table["split"] != "fitted"]
    return [GroupResidual(r.source, str(r.run), str(r.group), r.deployment, r.chip, r.cls,
                          float(r.step_log_ratio), float(r.ttft_residual_s))
            for r in use.itertuples()]


def test_the_shipped_error_model_is_what_the_committed_residuals_give():
    """catalog/uncertainty/error-model.yaml was written by python -m validation.error_model
    from these residuals (tests/data/intervals/residuals.csv, its --residuals output): the
    systematic spreads and the front end are recomputed here from the table alone."""
    table = pd.read_csv(DATA / "residuals.csv")
    shipped = shipped_error_model()
    got = systematic([], _groups(table))
    for c in CLASSES:
        for a, b in zip(got[c], shipped.systematic[c]):
            assert a.bias == pytest.approx(b.bias, abs=1e-6), c
            assert a.sd == pytest.approx(b.sd, abs=1e-6), c
            assert (a.count, a.borrowed_from) == (b.count, b.borrowed_from), c
    fe = front_end(_groups(table))
    assert fe.bias_s == pytest.approx(shipped.front_end.bias_s, abs=1e-7)
    assert fe.sd_s == pytest.approx(shipped.front_end.sd_s, abs=1e-7)


def test_residuals_cover_every_source_and_keep_the_held_out_split():
    table = pd.read_csv(DATA / "residuals.csv")
    assert set(table["source"]) == {"residency-vllm", "trainval", "llm-d", "llmservingsim"}
    assert (table[table["source"] == "residency-vllm"]["split"] == "fitted").sum() == 1
    # the front end reads client-timed light loads only; with the front end fitted by the
    # serving calibration what is left of it scatters about zero, within a tenth of a second
    fe = table[table["ttft_residual_s"].notna()]
    assert set(fe["source"]) == {"residency-vllm", "trainval"}
    assert fe["ttft_residual_s"].abs().lt(0.1).all()
    assert table["step_log_ratio"].notna().all()


def test_coverage_cells_recompute_from_their_draws():
    """Each committed coverage cell's verdicts follow from its own draws and measured value
    (the notebook's calibration plot recomputes them for every level)."""
    cells = pd.read_csv(DATA / "coverage.csv")
    assert len(cells) >= 30 and set(cells["metric"]) == {"ttft_mean", "itl_mean", "e2e_mean"}
    for r in cells.itertuples():
        draws = np.array([float(x) for x in r.values.split()])
        assert len(draws) == r.draws
        for lv in (50, 80):
            _, lo, hi = interval(draws, lv / 100)
            assert lo == pytest.approx(getattr(r, f"low_{lv}"), rel=1e-4)
            assert getattr(r, f"in_{lv}") == bool(lo <= r.measured <= hi)
        assert math.isfinite(r.point)
