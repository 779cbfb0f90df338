"""The step's typed stages (jkernel/stages.py): the per-resource record, the request lanes a
plan has (a static spec) and their sums as a record, the step's counts and their views."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkernel
from jkernel import laws
from jkernel.stages import (RESOURCES, BatchArrays, NeedsRequests, RequestLanes, Resources,
                            StepBatch, StepInputs, StepOptions, sum_requests)

from conftest import catalog_kernel, spec_kernel

SCENARIOS = ["llama-3.1-8b-h100-tp1", "gpt-oss-120b-b200-tp8", "qwen3-235b-a22b-h200-tp8-dcp2",
             "glm-5-h200-2node-pcp2-dcp2", "nemotron-3-super-120b-a12b-b200-tp2-mtp",
             "deepseek-v3.2-h200-fp8-tp8-dcp2"]


def _arrays(n_batches: int = 3, width: int = 16, seed: int = 0) -> BatchArrays:
    rng = np.random.default_rng(seed)
    s = np.where(rng.random((n_batches, width)) < 0.6, 1,
                 rng.integers(0, 3000, (n_batches, width))).astype(np.int32)
    c = rng.integers(0, 50_000, (n_batches, width)).astype(np.int32)
    ones, zeros = np.ones(n_batches, np.int32), np.zeros(n_batches, np.int32)
    return BatchArrays(s, c, s > 0, ones, zeros, zeros)


# -- Resources -------------------------------------------------------------------------------

def test_resources_read_by_field_name_and_index():
    r = Resources(1.0, 2.0, 3.0, 4.0, 5.0)
    assert RESOURCES == jkernel.RESOURCES == ("sm", "hbm", "nvlink", "nic", "host")
    assert r.hbm == r["hbm"] == r[1] == 2.0
    assert r[1:3] == (2.0, 3.0) and list(r) == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert r.keys() == RESOURCES and r.as_dict() == dict(r.items())
    assert sum(r.values()) == 15.0
    with pytest.raises(KeyError, match="not a resource"):
        r["dram"]


def test_resources_is_a_pytree_in_field_order():
    r = Resources(*(jnp.asarray(float(i)) for i in range(5)))
    assert [float(x) for x in jax.tree_util.tree_leaves(r)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    doubled = jax.jit(lambda x: jax.tree_util.tree_map(lambda v: 2 * v, x))(r)
    assert isinstance(doubled, Resources) and float(doubled.host) == 8.0


def test_step_estimate_per_resource_s_is_resources():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    est = k.step_time(jkernel.Batch.from_spec("8x1@1000"))
    assert isinstance(est.per_resource_s, Resources)
    assert est.per_resource_s["hbm"] == est.per_resource_s.hbm > 0


# -- StepOptions -------------------------------------------------------------------------------

def test_options_maximum_is_hard_at_zero_temperature_and_smooth_above():
    a, b = jnp.asarray(1.0), jnp.asarray(3.0)
    assert float(StepOptions().maximum(a, b)) == 3.0
    assert float(StepOptions().maximum(a)) == 1.0
    smooth = float(StepOptions(smooth_temperature=0.05).maximum(a, b))
    assert 3.0 <= smooth < 3.2


# -- the request lanes -------------------------------------------------------------------------

def test_lanes_follow_the_plan():
    """Each plan's spec names the lanes its step needs, and no others."""
    plain = RequestLanes.of(catalog_kernel("llama-3.1-8b-h100-tp1").plan)
    assert (plain.read_shapes, plain.windows, plain.context, plain.prefill_context,
            plain.draft, plain.requests, plain.expected_view) == ((), (), False, False, False,
                                                                  False, False)
    swa = RequestLanes.of(catalog_kernel("gpt-oss-120b-b200-tp8").plan)
    assert swa.windows and swa.read_shapes and all(s.integral for s in swa.read_shapes)
    gqa_dcp = RequestLanes.of(catalog_kernel("qwen3-235b-a22b-h200-tp8-dcp2").plan)
    assert gqa_dcp.context and not gqa_dcp.prefill_context and not gqa_dcp.requests
    latent_dcp = RequestLanes.of(catalog_kernel("deepseek-v3.2-h200-fp8-tp8-dcp2").plan)
    assert latent_dcp.prefill_context and latent_dcp.requests and latent_dcp.expected_view
    pcp = RequestLanes.of(catalog_kernel("glm-5-h200-2node-pcp2-dcp2").plan)
    assert pcp.pcp == 2 and pcp.expected_view
    mtp = RequestLanes.of(catalog_kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp").plan)
    assert mtp.draft


def test_lanes_are_static_and_hashable():
    plan = catalog_kernel("gpt-oss-120b-b200-tp8").plan
    a, b = RequestLanes.of(plan), RequestLanes.of(dataclasses.replace(plan))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.draft = True


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("check", [False, True])
def test_sums_have_the_structure_the_spec_describes(scenario, check):
    """The split program rebuilds the sums from a vector with the spec alone (no list
    filled while tracing): the spec's template has the structure of the real sums, its
    size is their lane count, and unstacking their leaves gives them back."""
    lanes = RequestLanes.of(catalog_kernel(scenario).plan)
    sums = sum_requests(lanes, _arrays(), jnp.float64, check)
    leaves = jax.tree_util.tree_leaves(sums)
    assert jax.tree_util.tree_structure(sums) == \
        jax.tree_util.tree_structure(lanes.template(check))
    assert lanes.size(check) == len(leaves) == len(sums.lane_names())
    again = lanes.unstack(leaves, check)
    for x, y in zip(jax.tree_util.tree_leaves(again), leaves):
        assert x is y
    assert (sums.negative is not None) == check
    assert len(sums.decode_reads) == len(sums.live_reads) == len(lanes.read_shapes)
    assert len(sums.windowed) == len(sums.window_row_max) == len(lanes.windows)


def test_sums_count_tokens_requests_and_maxima():
    lanes = RequestLanes.of(catalog_kernel("llama-3.1-8b-h100-tp1").plan)
    s = np.array([[1, 1, 50, 0]], np.int32)
    c = np.array([[10, 20, 5, 99]], np.int32)
    one = np.ones(1, np.int32)
    sums = sum_requests(lanes, BatchArrays(s, c, s > 0, one, 0 * one, 0 * one), jnp.float64)
    assert float(sums.tokens[0]) == 52 and float(sums.n_live[0]) == 3
    assert float(sums.prefill_requests[0]) == 1 and float(sums.prefill_tokens[0]) == 50
    assert float(sums.decode_kv_tokens[0]) == 11 + 21
    assert float(sums.live_kv_tokens[0]) == 11 + 21 + 55
    assert float(sums.row_max[0]) == 4 * 5 + 2 * 50         # one prefill: its own row work


# -- the step's counts and its views ---------------------------------------------------------

def test_counts_follow_from_the_sums():
    k = spec_kernel()
    lanes = RequestLanes.of(k.plan)
    arrays = k.batch_arrays(jkernel.Batch.from_spec("4x1@100,1x300@0"), 16)
    b = StepBatch.from_sums(lanes, arrays, sum_requests(lanes, arrays, jnp.float64),
                            jnp.float64)
    assert float(b.tokens) == 304 and float(b.decode_requests) == 4
    assert float(b.decode_tokens) == 4 and float(b.prefill_tokens) == 300
    assert float(b.t_gemm) == float(b.t_real) == 304 and not bool(b.empty)
    assert bool(b.uniform) is False and b.pcp is None and b.requests is None


def test_a_plan_reading_requests_needs_the_arrays():
    """The latent DCP context gather reads the requests after the reduction: counts built
    from sums alone refuse, which sends that plan's single step to the one program."""
    lanes = RequestLanes.of(catalog_kernel("deepseek-v3.2-h200-fp8-tp8-dcp2").plan)
    arrays = _arrays(1)
    sums = sum_requests(lanes, arrays, jnp.float64)
    assert StepBatch.from_sums(lanes, arrays, sums, jnp.float64).requests is not None
    bare = BatchArrays(None, None, None, *arrays[3:])
    with pytest.raises(NeedsRequests):
        StepBatch.from_sums(lanes, bare, sums, jnp.float64)


def test_draft_pass_decodes_one_token_per_live_request():
    k = catalog_kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp")
    lanes = RequestLanes.of(k.plan)
    arrays = k.batch_arrays(jkernel.Batch.from_spec("3x1@100,1x40@0"), 16)
    b = StepBatch.from_sums(lanes, arrays, sum_requests(lanes, arrays, jnp.float64),
                            jnp.float64)
    d = b.draft_pass()
    assert float(d.tokens) == float(d.decode_tokens) == float(d.n_live) == 4
    assert float(d.prefill_requests) == 0 and float(d.causal_flops) == 0
    assert float(d.decode_kv_tokens) == 3 * 102 + 41       # context + tokens + 1
    assert float(d.prefill_rows(0)) == 0.0 and d.draft is None


def test_pcp_expected_view_prices_vllms_split():
    """Refinement 8: expected_s's view of a PCP step runs vLLM's 2·ceil(s/(2·pcp)) rows per
    prefill; the edges' view keeps the spec's rank-local tokens."""
    k = catalog_kernel("glm-5-h200-2node-pcp2-dcp2")
    lanes = RequestLanes.of(k.plan)
    arrays = k.batch_arrays(jkernel.Batch.from_spec("1x1001@0"), 16)
    b = StepBatch.from_sums(lanes, arrays, sum_requests(lanes, arrays, jnp.float64),
                            jnp.float64)
    v = b.expected_view()
    assert v.envelope and not b.envelope
    assert float(v.prefill_tokens) == 2 * np.ceil(1001 / 4)
    assert float(v.t_real) == float(v.prefill_tokens)
    st = StepInputs.of(b, 132.0, 0.8, 10.0)
    ev = st.expected_view(0.8, 10.0)
    assert ev.batch.envelope and float(ev.batch.t_gemm) == float(v.t_gemm)
    assert float(ev.r_g) == float(laws.ramp(v.t_gemm, 0.8, 10.0))      # its own ramps
    assert float(st.r_g) == float(laws.ramp(b.t_gemm, 0.8, 10.0))


@pytest.mark.parametrize("jit", [False, True])
def test_step_inputs_are_pytrees(jit):
    """The stage records cross jit as pytrees (their lanes spec static)."""
    k = catalog_kernel("gpt-oss-120b-b200-tp8")
    lanes = RequestLanes.of(k.plan)
    arrays = _arrays(2)

    def build(a):
        b = StepBatch.from_sums(lanes, a, sum_requests(lanes, a, jnp.float64), jnp.float64)
        return StepInputs.of(b, 148.0, 0.8, 10.0)

    st = jax.jit(build)(arrays) if jit else build(arrays)
    assert isinstance(st, StepInputs) and st.batch.lanes == lanes
    assert st.batch.tokens.shape == (2,) and st.has_live.shape == (2,)
    w = lanes.windows[0]
    assert st.batch.windowed(w).shape == (2,)


@pytest.mark.parametrize("scenario", ["llama-3.1-8b-h100-tp1", "glm-5-h200-2node-pcp2-dcp2"])
@pytest.mark.parametrize("n", [1, 5, 16, 32])
def test_sums_in_order_equal_the_reduction_to_the_bit(scenario, n):
    """The single step's small buckets sum their requests without a reducer (``in_order``);
    the sums equal the variadic reduction's exactly, float lanes with non-integer terms
    included (a PCP plan's split lanes), jitted, for one batch and for several."""
    lanes = RequestLanes.of(catalog_kernel(scenario).plan)
    rng = np.random.default_rng(n)
    for lead in ((), (3,)):
        s = np.where(rng.random(lead + (n,)) < 0.4, rng.integers(2, 9000, lead + (n,)), 1)
        s = np.where(rng.random(lead + (n,)) < 0.1, 0, s).astype(np.int32)
        c = rng.integers(0, 70000, lead + (n,)).astype(np.int32)
        one = np.ones(lead, np.int32)
        batch = BatchArrays(s, c, s > 0, one, 0 * one, 0 * one)
        for dt in (jnp.float64, jnp.float32):
            a = jax.jit(lambda b: sum_requests(lanes, b, dt, True))(batch)
            b = jax.jit(lambda b: sum_requests(lanes, b, dt, True, in_order=True))(batch)
            for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
                assert x.dtype == y.dtype
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
