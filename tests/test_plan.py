"""The static plan (jkernel/plan.py): per-kind figures from the graph, the one table of the
collectives a plan needs, and the check that no charged collective lacks a key."""

from __future__ import annotations

import dataclasses

import pytest

from jkernel import plan as _plan

from conftest import catalog_kernel, spec_kernel


def test_plan_is_hashable_and_frozen():
    p = spec_kernel().plan
    assert hash(p) == hash(dataclasses.replace(p))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.tp = 2


def test_layer_kinds_count_the_whole_stack():
    p = spec_kernel().plan
    assert sum(k.count for k in p.kinds) == p.total_layers == 61


def test_consecutive_column_parallel_gemms_fuse():
    """Llama's gate and up projections share K = hidden and fuse into one GEMM."""
    kind = catalog_kernel("llama-3.1-70b-h100-tp4").plan.kinds[0]
    fused = [g for g in kind.gemms if len(g.roles) > 1 or "gate_up" in g.roles[0]]
    assert fused and fused[0].n == 2 * 28672 and fused[0].k == 8192
    assert sum(g.flops_per_token for g in kind.gemms) == kind.dense_flops_per_token


def test_kv_heads_replicated_below_tp_in_vllm_fraction():
    """vLLM v0.31.0 replicates KV heads when n_kv < tp: 8 KV heads at tp 16 hold one each."""
    att = _plan.AttentionPlan("gqa", 64, 8, 128)
    whole = (64 + 16) * 128
    frac = _plan.vllm_rank_fraction("qkv_proj", whole, 16, att)
    assert frac == pytest.approx((64 / 16 + 2 * 1) * 128 / whole)
    assert _plan.vllm_rank_fraction("router", 10, 8, att) == 1.0


def test_collectives_needed_covers_what_the_step_charges():
    """The one table holds every collective the step charges, for plain TP, DCP with the
    a2a backend and PCP+DCP plans."""
    for name in ("llama-3.1-70b-h100-tp4", "qwen3-235b-a22b-h200-tp8-dcp2-a2a",
                 "glm-5-h200-2node-pcp2-dcp2", "qwen3-30b-a3b-h200-ep"):
        p = catalog_kernel(name).plan
        table = {(k.op, k.group) for k in p.collective_keys}
        charged = set(_plan.charged_collectives(p))
        assert charged and charged <= table, name


def test_dcp_a2a_plan_charges_the_dcp_alltoall():
    p = catalog_kernel("qwen3-235b-a22b-h200-tp8-dcp2-a2a").plan
    assert ("alltoall", "DCP") in _plan.charged_collectives(p)
    assert ("reduce_scatter", "DCP") not in _plan.charged_collectives(p)


def test_a_charged_collective_without_a_key_fails_when_the_plan_is_built():
    """Guards the silent zero: a collective the step prices but the table lacks used to
    price 0 s; now building such a plan raises, naming the collective."""
    p = catalog_kernel("llama-3.1-70b-h100-tp4").plan
    kept = tuple(k for k in p.collective_keys if k.op != "all_reduce")
    with pytest.raises(ValueError, match="all_reduce over TP"):
        dataclasses.replace(p, collective_keys=kept)


def test_key_lookup_of_an_absent_collective_raises():
    p = catalog_kernel("llama-3.1-8b-h100-tp1").plan
    assert p.collective_keys == ()
    with pytest.raises(KeyError):
        p.key("all_reduce", "TP")


def test_unused_plan_fields_are_gone():
    names = {f.name for f in dataclasses.fields(_plan.Plan)}
    assert not names & {"suffix", "kv_kind"}
    assert not hasattr(_plan.Plan, "decode_pair")


def test_attention_kinds_are_an_enum_with_their_properties():
    """A kind's latent and DCP-shardable properties live on the enum, one place."""
    K = _plan.AttentionKind
    assert [k for k in K if k.latent] == [K.MLA, K.SPARSE_MLA]
    assert [k for k in K if not k.dcp_shardable] == [K.SWA]
    assert K.MLA == "mla" and f"{K.SPARSE_MLA}" == "sparse_mla"
    att = _plan.AttentionPlan("mla", 128, 1, 576)            # a plan built by hand
    assert att.kind is K.MLA and att.kind.latent
    assert not hasattr(att, "latent")


def test_graph_modes_collective_ops_and_groups_are_enums():
    p = catalog_kernel("llama-3.1-70b-h100-tp4").plan
    assert isinstance(p.decode_mode, _plan.GraphMode) and p.decode_mode.name == "FULL"
    assert {type(k.op) for k in p.collective_keys} == {_plan.CollectiveOp}
    assert {type(g.name) for g in p.groups} == {_plan.Group}
    assert p.key(_plan.CollectiveOp.ALL_REDUCE, _plan.Group.TP) is p.key("all_reduce", "TP")
    assert "routed_a2a" not in {f.name for f in dataclasses.fields(_plan.Plan)}


@pytest.mark.parametrize("name", ["llama-3.1-70b-h100-tp4", "qwen3-235b-a22b-h200-tp8-dcp2-a2a",
                                  "glm-5-h200-2node-pcp2-dcp2", "qwen3-30b-a3b-h200-ep",
                                  "deepseek-v3.2-h200-fp8-tp8-dcp2",
                                  "kimi-k3-gb200-nvl72-ep72"])
def test_the_step_prices_exactly_the_launches_the_plan_lists(name):
    """One decision: the collective terms of each layer kind are the plan's launches (by
    name), and the collectives the plan checks keys for are theirs."""
    import jax

    import jkernel

    k = catalog_kernel(name)
    est = jax.jit(k.step_fn)(k.params, k.batch_arrays(jkernel.Batch.from_spec("4x1@3000,1x500@9")))
    launched = set()
    for kind in k.plan.kinds:
        launches = k.plan.launches(kind)
        launched |= {(x.op, x.group) for x in launches}
        names = {x.name for x in launches}
        priced = {n for n in est.terms[kind.id]
                  if n.startswith(("all_", "reduce_", "alltoall", "moe dispatch", "dcp ", "pcp "))}
        assert priced == names, kind.id
    assert launched == set(_plan.charged_collectives(k.plan))


def test_dcp_latent_plan_launches_in_pricing_order():
    p = catalog_kernel("deepseek-v3.2-h200-fp8-tp8-dcp2").plan
    kind = next(k for k in p.kinds if k.attention is not None)
    cp = [x for x in p.launches(kind) if x.rows is not _plan.Rows.HIDDEN]
    assert [x.name for x in cp] == ["dcp query all_gather", "dcp lse all_gather",
                                    "dcp output reduce_scatter", "dcp context gather"]
    assert cp[-1].rows is _plan.Rows.CONTEXT and cp[1].factors[0] == p.dcp
