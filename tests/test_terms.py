"""Named cost terms (jkernel/terms.py): the terms add up to the step's totals, the breakdown a
user reads, the README's worked step term by term, and the one decode-read decision."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkernel
from jkernel import terms
from jkernel.stages import primary_read
from jkernel.cli import main
from jkernel.plan import AttentionPlan, ReadShape, read_shape

from conftest import ROOT, catalog_kernel, spec_kernel

BATCHES = ["32x1@4096", "1x2048@0", "16x1@3000,1x1024@0", "1x32768@0", ""]


def _resource_sums(est):
    out = dict.fromkeys(jkernel.RESOURCES, 0.0)
    for per_kind in est.terms.values():
        for t in per_kind.values():
            for r, v in zip(jkernel.RESOURCES, t.per_resource_s):
                out[r] += float(v)
    return out


@pytest.mark.parametrize("name", [None, "glm-5-h200-2node-pcp2-dcp2",
                                  "nemotron-3-super-120b-a12b-b200-tp2-mtp"])
@pytest.mark.parametrize("spec", BATCHES)
def test_terms_sum_to_the_per_resource_totals(name, spec):
    """Σ over kinds and terms of each resource equals per_resource_s (1e-12 relative: the
    totals sum the same numbers grouped per layer), and the breakdown's expected column
    sums to expected_s. ``None``: the spec's DeepSeek-V3 kernel; then PCP+DCP, and MTP."""
    k = spec_kernel() if name is None else catalog_kernel(name)
    est = k._programs.jit_step(k.params, k.batch_arrays(jkernel.Batch.from_spec(spec)))
    sums = _resource_sums(est)
    for r in jkernel.RESOURCES:
        assert math.isclose(sums[r], float(est.per_resource_s[r]), rel_tol=1e-12,
                            abs_tol=1e-18), r
    table = k.breakdown(jkernel.Batch.from_spec(spec))
    assert math.isclose(table["expected_s"].sum(), float(est.expected_s), rel_tol=1e-12)
    for r in jkernel.RESOURCES:
        assert math.isclose(table[f"{r}_s"].sum(), float(est.per_resource_s[r]),
                            rel_tol=1e-12, abs_tol=1e-18)


def test_terms_unjitted_equal_jitted():
    k = spec_kernel()
    arrays = k.batch_arrays(jkernel.Batch.from_spec("16x1@3000,1x1024@0"))
    a = k.step_fn(k.params, arrays)
    b = k._programs.jit_step(k.params, arrays)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12, atol=0)


def test_estimate_with_terms_vmaps_and_differentiates():
    """StepEstimate (terms included) is a pytree: vmap gives every term a batch axis, and
    the gradient of one term's expected seconds is finite."""
    k = spec_kernel()
    one = k.batch_arrays(jkernel.Batch.from_spec("8x1@1000"), 16)
    two = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), one)
    est = jax.vmap(k.step_fn, in_axes=(None, 0))(k.params, two)
    for leaf in jax.tree_util.tree_leaves(est.terms):
        assert leaf.shape == (2,)

    def decode_read(params):
        e = k.step_fn(params, one)
        return sum(d["attention decode read"].expected_s for kid, d in e.terms.items()
                   if "attention decode read" in d)

    g = jax.grad(decode_read)(k.params)
    assert all(np.isfinite(float(v)) for v in g.values())
    assert float(g["attention_decode_rate"]) < 0        # a faster read is cheaper


def test_step_terms_are_named_once():
    """The host has its own named terms; the LM head, the gap and the serial time too."""
    k = spec_kernel()
    est = k._programs.jit_step(k.params, k.batch_arrays(jkernel.Batch.from_spec("4x1@10")))
    assert {"lm head", "host graph replay", "host kernel launches", "kernel gap",
            "host serial"} <= set(est.terms[terms.STEP])


def test_every_term_has_one_row_with_its_side():
    """One table says each term's side: the composers and the breakdown read it, no name
    lists. Fixed names are unique; families (GEMMs, secondary reads, collectives) are stage
    work; every step-level term the step publishes has its row."""
    names = [r.name for r in terms.LAYER_TERMS + terms.STEP_TERMS if r.name is not None]
    assert len(names) == len(set(names))
    assert all(r.side is terms.Side.STAGE for r in terms.LAYER_TERMS if r.name is None)
    assert terms.side("any kind", "routed experts") is terms.Side.SERIAL
    assert terms.side("any kind", "gemm qkv_proj") is terms.Side.STAGE
    sides = {n: terms.side(terms.STEP, n) for n in ("lm head", "draft passes", "kernel gap",
                                                    "host graph replay",
                                                    "host kernel launches", "host serial")}
    assert sides == {"lm head": terms.Side.STAGE, "draft passes": terms.Side.STAGE,
                     "kernel gap": terms.Side.STAGE, "host graph replay": terms.Side.HOST,
                     "host kernel launches": terms.Side.HOST,
                     "host serial": terms.Side.HOST_SERIAL}
    k = catalog_kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp")
    est = jax.jit(k.step_fn)(k.params, k.batch_arrays(jkernel.Batch.from_spec("4x2@100")))
    assert set(est.terms[terms.STEP]) == {r.name for r in terms.STEP_TERMS}


def test_expected_only_terms_charge_no_resource():
    """The rows the edges do not charge (the drafter, the kernel gap, the serial host time)
    put no seconds on any resource."""
    k = catalog_kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp")
    est = jax.jit(k.step_fn)(k.params, k.batch_arrays(jkernel.Batch.from_spec("4x2@100,1x90@0")))
    for row in terms.STEP_TERMS:
        t = est.terms[terms.STEP][row.name]
        if not row.edges:
            assert all(float(v) == 0.0 for v in t.per_resource_s), row.name


# -- the README's worked step ---------------------------------------------------------------

def _readme_rows():
    text = (ROOT / "README.md").read_text()
    section = text.split("## A worked step, by hand", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and not r.startswith("| term")]
    return section, {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[1:-1]]
                     for r in rows}


def _ms(cell: str) -> float:
    return float(re.findall(r"([\d.]+) ms", cell)[-1])


def test_readme_worked_step_matches_the_breakdown(capsys):
    """`jkernel price llama-3.1-70b-h100-tp4 --batch 32x1@4096 --breakdown` prints the
    README's by-hand table term by term (at the README's printed precision)."""
    assert main(["price", "llama-3.1-70b-h100-tp4", "--batch", "32x1@4096", "--breakdown",
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    table = row["breakdown"]
    by = {(r["kind"], r["term"]): r for r in table}

    def total(resource, pred):
        return sum(r[resource] for r in table if pred(r["term"])) * 1e3

    section, cells = _readme_rows()
    gemm = lambda t: t.startswith("gemm ")  # noqa: E731
    checks = [
        (cells[next(k for k in cells if k.startswith("weights"))][-1], total("hbm_s", gemm)),
        (cells[next(k for k in cells if k.startswith("norms"))][-1],
         total("hbm_s", lambda t: t == "norms and elementwise")),
        (cells[next(k for k in cells if k.startswith("KV read"))][-1],
         total("hbm_s", lambda t: t == "attention decode read")),
        (cells[next(k for k in cells if k.startswith("LM head weights"))][-1],
         total("hbm_s", lambda t: t == "lm head")),
        (cells[next(k for k in cells if k.startswith("GEMMs at"))][-1], total("sm_s", gemm)),
        (cells[next(k for k in cells if k.startswith("LM head 32"))][-1],
         total("sm_s", lambda t: t == "lm head")),
        (cells[next(k for k in cells if k.startswith("2 all-reduces"))][-1],
         total("nvlink_s", lambda t: t == "all_reduce TP")),
        (cells[next(k for k in cells if k.startswith("host"))][-1],
         total("host_s", lambda t: t.startswith("host "))),
    ]
    for cell, got in checks:
        assert abs(_ms(cell) - got) <= 0.0005 + 1e-9, (cell, got)
    # the per-GEMM compute times of one layer, µs
    gemms = cells[next(k for k in cells if k.startswith("GEMMs at"))][0]
    for role, us in (("qkv_proj", r"qkv .*?→ ([\d.]+) µs"), ("o_proj", r"o \(.*?→ ([\d.]+) µs"),
                     ("mlp_gate_up", r"gate-up .*?→ ([\d.]+) µs"),
                     ("mlp_down", r"down .*?→ ([\d.]+) µs")):
        printed = float(re.search(us, gemms).group(1))
        got = by[("attn_dense", f"gemm {role}")]["sm_s"] / 80 * 1e6
        assert abs(printed - got) <= 0.005 + 1e-9, (role, printed, got)
    # the summary line and the three estimates
    for name, key in (("SM", "sm"), ("HBM", "hbm"), ("NVLink", "nvlink"), ("host", "host")):
        printed = float(re.search(rf"{name} = ([\d.]+) ms", section).group(1))
        assert abs(printed - row["per_resource_s"][key] * 1e3) <= 0.0005 + 1e-9
    for label, key in (("NoOverlap", "no_overlap_s"), ("Overlap", "overlap_s"),
                       ("expected_s", "expected_s")):
        printed = float(re.search(rf"\*\*{label}\*\*.*?([\d.]+) ms", section, re.S).group(1))
        assert abs(printed - row[key] * 1e3) <= 0.0005 + 1e-9, label
    assert math.isclose(sum(r["expected_s"] for r in table), row["expected_s"], rel_tol=1e-12)


def test_cli_breakdown_prints_a_table(capsys):
    assert main(["price", "llama-3.1-70b-h100-tp4", "--batch", "32x1@4096",
                 "--breakdown"]) == 0
    out = capsys.readouterr().out
    assert "where the time goes" in out
    assert re.search(r"attn_dense\s+80\s+attention decode read\s+0\.000\s+5\.545", out)
    assert re.search(r"total\s+2\.075\s+17\.887\s+2\.121\s+0\.000\s+2\.573\s+21\.660\s+100\.0%",
                     out)


# -- the one decode-read decision -----------------------------------------------------------

def test_read_shape_is_none_for_a_plain_context_read():
    plan = spec_kernel().plan
    assert read_shape(plan, AttentionPlan("gqa", 8, 1, 128)) is None
    shape = read_shape(plan, AttentionPlan("swa", 8, 1, 128, window=128))
    assert shape == ReadShape(window=128)
    assert float(primary_read(shape, jnp.asarray(1000.0))) == 128.0
    assert float(primary_read(None, jnp.asarray(1000.0))) == 1000.0
    sparse = read_shape(plan, AttentionPlan("sparse_mla", 8, 1, 576, index_topk=2048))
    assert sparse.sparse_bound == 2048 and sparse.window == 0
    assert float(primary_read(sparse, jnp.asarray(100.0))) == 100.0
    assert float(primary_read(sparse, jnp.asarray(10_000.0))) == 2048.0
