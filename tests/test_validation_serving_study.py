"""validation/serving_study.py: the before/after tables, their medians and the acceptance
lines, on small made-up tables (the replays themselves are tests/test_validation_serving_runs
.py's)."""

from __future__ import annotations

import pandas as pd
import pytest

from validation.serving_study import TARGETS, acceptance, joined, markdown, medians


def _table(errors: dict, replayed: int = 100) -> pd.DataFrame:
    rows = []
    for (source, run, split), (ttft, itl, e2e) in errors.items():
        rows.append({"source": source, "run": run, "group": "all", "split": split,
                     "chip": "h100", "family": "llama", "model": "m", "requests": 100,
                     "replayed": replayed, "ttft_mean_measured": 0.05,
                     "itl_mean_measured": 0.01, "e2e_mean_measured": 2.0,
                     "ttft_mean_error": ttft, "itl_mean_error": itl, "e2e_mean_error": e2e})
    return pd.DataFrame(rows)


BEFORE = {("s", "a", "held-out"): (-0.20, 0.04, 0.04), ("s", "b", "held-out"): (-0.10, 0.01, 0.01),
          ("s", "c", "fit"): (-0.30, 0.02, 0.02)}
AFTER = {("s", "a", "held-out"): (-0.05, 0.04, 0.04), ("s", "b", "held-out"): (0.02, 0.06, 0.01),
         ("s", "c", "fit"): (0.01, 0.02, 0.02)}


def test_joined_pairs_groups_and_medians_split_fit_from_held_out():
    t = joined(_table(BEFORE), _table(AFTER))
    assert len(t) == 3
    m = medians(t, "source").set_index("split")
    assert m.loc["held-out", "ttft_mean_before_abs"] == pytest.approx(0.15)
    assert m.loc["held-out", "ttft_mean_after_abs"] == pytest.approx(0.035)
    assert m.loc["fit", "groups"] == 1


def test_acceptance_names_the_groups_beyond_each_bound():
    t = joined(_table(BEFORE), _table(AFTER))
    acc = {(a["metric"], a["when"]): a for a in acceptance(t) if a["source"] == "s"}
    assert acc[("ttft_mean", "after")]["holds"] and not acc[("ttft_mean", "before")]["holds"]
    assert acc[("ttft_mean", "before")]["misses"] == ["a all"]
    itl = acc[("itl_mean", "after")]
    assert not itl["holds"] and itl["misses"] == ["b all"]       # 6 % > 5 %
    assert itl["each_bound"] == TARGETS["itl_mean"][0]


def test_a_run_that_stops_replaying_fails_the_replays_line():
    t = joined(_table(BEFORE), _table(AFTER, replayed=90))
    (line,) = [a for a in acceptance(t) if a["metric"] == "replays"]
    assert not line["holds"] and len(line["misses"]) == 3
    text = markdown(t)
    assert "### Acceptance on the held-out runs" in text and "### Medians per family" in text
