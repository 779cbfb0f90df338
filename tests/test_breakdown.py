"""Where a step's time goes (jkernel/breakdown.py): the table's columns and rows add up to
the estimate, and each term shows its part of expected_s on the side it belongs to."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

import jkernel
from jkernel.breakdown import BREAKDOWN_COLUMNS, breakdown_table
from jkernel.terms import STEP

from conftest import catalog_kernel


def _table(k, spec: str):
    est = jax.jit(k.step_fn)(k.params, k.batch_arrays(jkernel.Batch.from_spec(spec)))
    return est, breakdown_table(k.plan, est)


def test_columns_and_rows():
    k = catalog_kernel("llama-3.1-70b-h100-tp4")
    est, table = _table(k, "32x1@4096")
    assert tuple(table.columns) == BREAKDOWN_COLUMNS
    assert BREAKDOWN_COLUMNS[3:8] == tuple(f"{r}_s" for r in jkernel.RESOURCES)
    n = sum(len(d) for d in est.terms.values())
    assert len(table) == n
    step = table[table.kind == STEP]
    assert set(step.term) == set(est.terms[STEP]) and set(step.layers) == {1}
    assert set(table[table.kind == "attn_dense"].layers) == {80}


@pytest.mark.parametrize("spec", ["32x1@4096", "1x8192@0", "16x1@3000,1x1024@0"])
def test_rows_sum_to_the_estimate(spec):
    k = catalog_kernel("qwen3-30b-a3b-h200-ep")
    est, table = _table(k, spec)
    for r in jkernel.RESOURCES:
        assert math.isclose(table[f"{r}_s"].sum(), float(est.per_resource_s[r]),
                            rel_tol=1e-12, abs_tol=1e-18), r
    assert math.isclose(table.expected_s.sum(), float(est.expected_s), rel_tol=1e-12)
    assert math.isclose(table.share.sum(), 1.0, rel_tol=1e-9)


def test_host_terms_hidden_under_a_longer_gpu_side():
    """A large step is GPU-critical: the host terms show 0 expected seconds, the host-serial
    term its own, the GPU terms theirs."""
    k = catalog_kernel("llama-3.1-70b-h100-tp4")
    est, table = _table(k, "32x1@4096")
    by = table.set_index("term")
    assert by.loc["host graph replay", "expected_s"] == 0.0
    assert by.loc["host kernel launches", "host_s"] > 0
    assert by.loc["host serial", "expected_s"] == pytest.approx(
        float(est.terms[STEP]["host serial"].expected_s), rel=1e-15)
    assert by.loc["lm head", "expected_s"] > 0


def test_empty_step_is_host_critical():
    """An empty step has no GPU time: the host terms carry the expected seconds."""
    k = catalog_kernel("llama-3.1-70b-h100-tp4")
    est, table = _table(k, "")
    host = table[table.term.isin(["host graph replay", "host kernel launches"])]
    assert host.expected_s.sum() == pytest.approx(float(est.expected_s), rel=1e-12)
    assert np.all(table[~table.term.str.startswith("host")].expected_s == 0.0)


def test_packed_estimate_has_no_terms():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    est = k.step_time(jkernel.Batch.from_spec("4x1@10"))
    with pytest.raises(ValueError, match="no terms"):
        breakdown_table(k.plan, est)


def test_kernel_breakdown_is_the_table():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    batch = jkernel.Batch.from_spec("4x1@10,1x200@0")
    _, table = _table(k, "4x1@10,1x200@0")
    got = k.breakdown(batch)
    assert got.equals(table)
