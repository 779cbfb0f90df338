"""The step path against vectors.md §1.10–§1.11 and §4, on the spec's own coefficients.

Every check prices through the jitted ``Kernel.step_time`` and, where marked, also through
the bare ``step_fn`` with jit disabled, so both paths are held to the same numbers.
"""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest
import yaml

import jkernel
from jkernel import Batch, laws
from conftest import SPEC_CATALOG, spec_kernel

NS = 1e-9
US = 1e-6


def unjitted(k: jkernel.Kernel, batch: Batch) -> jkernel.StepEstimate:
    with jax.disable_jit():
        est = k.step_fn(k.params, k.batch_arrays(batch))
    return jkernel.StepEstimate(float(est.overlap_s), float(est.no_overlap_s),
                                float(est.expected_s),
                                {r: float(v) for r, v in est.per_resource_s.items()},
                                int(est.bottleneck))


def both(k, batch):
    return [k.step_time(batch), unjitted(k, batch)]


def bundle(model: str, *, chip: str = "h200", tp: int = 1, dp: int = 1, ep: bool = False,
           gpus: int = 8, **engine) -> list[dict]:
    """A one-pool bundle on the spec fixture catalog, as two mappings."""
    sc = {"kind": "Scenario", "name": f"{model}-test", "model": model,
          "engine_version": "0.31.0", "coefficients": ["spec-vectors"],
          "cluster": {"hardware": chip, "nodes": 1, "gpus_per_node": gpus}}
    dep = {"kind": "Deployment", "name": "d", "pools": [
        {"role": "colocated", "nodes": 1,
         "parallel": {"tp": tp, "pp": 1, "dp": dp, "enable_expert_parallel": ep},
         "engine": dict(engine)}]}
    return [sc, dep]


def open_spec(b, spec_repos) -> jkernel.Kernel:
    return jkernel.open(b, spec_repos)


DSV3_BATCH = Batch([1] * 32, [4095] * 32, decode_threshold=8)


# -- vectors.md §4.3 / §4.2 -----------------------------------------------------------------

def test_deepseek_v3_decode_matches_spec_coefficient_table():
    """vectors.md §4.3 [S]: per-resource ns within the stated truncation tolerance."""
    k = spec_kernel()
    for est in both(k, DSV3_BATCH):
        per = est.per_resource_s
        assert per["sm"] / NS == pytest.approx(3_811_939, abs=1.5)
        assert per["hbm"] / NS == pytest.approx(16_435_408, abs=1.5)
        assert per["nvlink"] / NS == pytest.approx(2_554_616, abs=1.5)
        assert per["host"] / NS == pytest.approx(3_544_399, abs=1.5)
        assert per["nic"] == 0.0
        assert est.no_overlap_s / NS == pytest.approx(26_346_362, abs=4)
        assert est.overlap_s / NS == pytest.approx(23_466_869, abs=2.5)
        assert jkernel.RESOURCES[est.bottleneck] == "hbm"


def test_deepseek_v3_intermediates():
    """vectors.md §4.2 [C]: host = 62·R + 972·k, plan counts, 122 all-reduces of 458,752 B."""
    k = spec_kernel()
    assert (k.plan.segments, k.plan.total_kernels) == (62, 972)
    est = k.step_time(DSV3_BATCH)
    assert est.per_resource_s["host"] == pytest.approx(62 * 7e-6 + 972 * 3.2e-6, rel=1e-12)
    one = laws.collective_time(32 * 7168 * 2, 15.98e-6, 131566e6, 92500e6)
    assert float(one) / US == pytest.approx(20.9395, abs=5e-5)
    assert est.per_resource_s["nvlink"] == pytest.approx(122 * float(one), rel=1e-12)
    assert float(laws.ramp(32, 0.788, 94)) == pytest.approx(0.2001270, abs=1e-7)


def test_reference_sanity_band():
    """vectors.md §4.1 [R] structure: NoOverlap is the sum, HBM leads, Overlap < NoOverlap."""
    est = spec_kernel().step_time(DSV3_BATCH)
    assert est.no_overlap_s == pytest.approx(sum(est.per_resource_s.values()), rel=1e-12)
    assert est.overlap_s < est.no_overlap_s
    assert 20e-3 < est.no_overlap_s < 32e-3


# -- graph modes and the capture ceiling (§1.10, §1.11, §4.5.5) -----------------------------

R, E, KL = 7e-6, 7e-6, 3.2e-6


def host_of(k, batch):
    return k.step_time(batch).per_resource_s["host"]


@pytest.mark.parametrize("mode,batch,expect", [
    ("FULL_AND_PIECEWISE", Batch([1] * 4, [100] * 4), "full"),
    ("FULL_AND_PIECEWISE", Batch([1, 1, 50], [100, 100, 0]), "piecewise"),
    ("FULL_DECODE_ONLY", Batch([1, 1, 50], [100, 100, 0]), "eager"),
    ("NONE", Batch([1] * 4, [100] * 4), "eager"),
    ("PIECEWISE", Batch([1] * 4, [100] * 4), "piecewise"),
    ("PIECEWISE", Batch([1, 1, 50], [100, 100, 0]), "piecewise"),
    ("", Batch([1] * 4, [100] * 4), "full"),
    ("", Batch([1, 1, 50], [100, 100, 0]), "piecewise"),
])
def test_graph_mode_per_step(spec_repos, mode, batch, expect):
    """vectors.md §1.11: host = per-step term of the selected mode + k·K."""
    engine = {"cudagraph_mode": mode} if mode else {}
    k = open_spec(bundle("tiny-llm", max_num_seqs=64, **engine), spec_repos)
    L, seg, K = k.plan.total_layers, k.plan.segments, k.plan.total_kernels
    per_step = {"full": R, "piecewise": R * seg, "eager": E * L}[expect]
    for est in both(k, batch):
        assert est.per_resource_s["host"] == pytest.approx(per_step + KL * K, rel=1e-12)


def test_unstated_mode_prices_as_full_and_piecewise(spec_repos):
    a = open_spec(bundle("tiny-llm"), spec_repos)
    b = open_spec(bundle("tiny-llm", cudagraph_mode="FULL_AND_PIECEWISE"), spec_repos)
    for batch in (Batch([1] * 4, [9] * 4), Batch([1, 300], [9, 0])):
        assert a.step_time(batch) == b.step_time(batch)
    assert a.fixed_bytes() == b.fixed_bytes()


def test_speculative_uniform_decode_uses_decode_mode(spec_repos):
    """Three tokens per request with num_spec 2 is a uniform decode (width 1 + 2)."""
    k = open_spec(bundle("tiny-llm", speculative={"method": "eagle", "num_spec_tokens": 2}),
                  spec_repos)
    K = k.plan.total_kernels
    assert host_of(k, Batch([3] * 8, [50] * 8, decode_threshold=3)) == \
        pytest.approx(R + KL * K, rel=1e-12)


@pytest.mark.parametrize("seqs,spec,blackwell,ceiling", [(64, 0, False, 128), (1024, 0, False, 512),
                                                         (256, 0, False, 512), (64, 3, False, 512),
                                                         (1024, 0, True, 1024)])
def test_capture_ceilings(spec_repos, seqs, spec, blackwell, ceiling):
    """vectors.md §1.10."""
    engine = {"max_num_seqs": seqs}
    if spec:
        engine["speculative"] = {"method": "mtp", "num_spec_tokens": spec}
    k = open_spec(bundle("tiny-llm", chip="b200" if blackwell else "h200", **engine),
                  spec_repos)
    assert k.plan.capture_ceiling == ceiling
    assert k.assumption("max_cudagraph_capture_size").startswith(f"{ceiling}:")


def test_capture_ceiling_none_is_zero(spec_repos):
    k = open_spec(bundle("tiny-llm", cudagraph_mode="NONE"), spec_repos)
    assert k.plan.capture_ceiling == 0
    assert k.assumption("max_cudagraph_capture_size") is None


def test_above_the_ceiling_runs_eager(spec_repos):
    """A prefill of ceiling + 1 tokens, and 513 single-token decodes at seqs ≥ 256."""
    k = open_spec(bundle("tiny-llm", max_num_seqs=256), spec_repos)
    L, K = k.plan.total_layers, k.plan.total_kernels
    assert host_of(k, Batch([513], [0])) == pytest.approx(E * L + KL * K, rel=1e-12)
    assert host_of(k, Batch([1] * 513, [10] * 513)) == pytest.approx(E * L + KL * K, rel=1e-12)
    assert host_of(k, Batch([1] * 512, [10] * 512)) == pytest.approx(R + KL * K, rel=1e-12)


def test_capture_ceiling_is_met_at_the_padded_count(spec_repos):
    """vectors.md §4.5.5: 500 decodes + pad 12 is FULL; + pad 13 is EAGER."""
    k = open_spec(bundle("tiny-llm", max_num_seqs=256), spec_repos)
    L, K = k.plan.total_layers, k.plan.total_kernels
    assert host_of(k, Batch([1] * 500, [10] * 500, pad_tokens=12)) == \
        pytest.approx(R + KL * K, rel=1e-12)
    assert host_of(k, Batch([1] * 500, [10] * 500, pad_tokens=13)) == \
        pytest.approx(E * L + KL * K, rel=1e-12)


# -- the empty step and pad tokens (§4.1, §4.5) ----------------------------------------------

def test_empty_step_is_host_only():
    """D2: no tokens and no pad: the decode-mode per-step host term, no launch term."""
    k = spec_kernel()
    for batch in (Batch(), Batch([0, 0], [5, 7])):
        for est in both(k, batch):
            assert est.per_resource_s["host"] == pytest.approx(62 * R, rel=1e-12)
            assert est.overlap_s == est.no_overlap_s == est.per_resource_s["host"]
            assert jkernel.RESOURCES[est.bottleneck] == "host"
            assert est.resources() == {"host": est.per_resource_s["host"]}


def test_zero_pad_is_the_unpadded_price():
    k = spec_kernel()
    assert k.step_time(Batch([1] * 8, [99] * 8, pad_tokens=0)) == \
        k.step_time(Batch([1] * 8, [99] * 8))


def test_pad_only_runs_gemms_not_attention_or_head():
    """vectors.md §4.5.3: no attention floor, KV read or head; launch term charged."""
    k = spec_kernel()
    est = k.step_time(Batch([], [], pad_tokens=16))
    assert est.per_resource_s["host"] == pytest.approx(62 * R + 972 * KL, rel=1e-12)
    inflated = k.with_params(k.params.scaled(attention_decode_floor=10.0,
                                             attention_decode_rate=0.1))
    assert inflated.step_time(Batch([], [], pad_tokens=16)) == est
    assert est.per_resource_s["hbm"] > 0 and est.per_resource_s["sm"] > 0


def test_pad_against_extra_requests():
    """vectors.md §4.5.4: n decodes + pad p against n + p decodes at the same context."""
    k = spec_kernel()
    n, p, ctx = 8, 8, 1000
    a = k.step_time(Batch([1] * n, [ctx - 1] * n, pad_tokens=p, decode_threshold=8))
    b = k.step_time(Batch([1] * (n + p), [ctx - 1] * (n + p), decode_threshold=8))
    for r in ("nvlink", "nic", "host"):
        assert a.per_resource_s[r] == pytest.approx(b.per_resource_s[r], rel=1e-12)
    P = 1979e12
    head = lambda t: t * 2 * 129280 * 7168 / 8 / (P * float(laws.ramp(t, 0.788, 94)))  # noqa
    assert b.per_resource_s["sm"] - a.per_resource_s["sm"] == \
        pytest.approx(head(n + p) - head(n), rel=1e-9)
    bpt, rate = 576.0, 2784000e6
    assert b.per_resource_s["hbm"] - a.per_resource_s["hbm"] == \
        pytest.approx(61 * p * ctx * bpt / rate, rel=1e-9)


def test_bucket_padding_changes_no_price():
    """D32: zero-padding a batch to a larger bucket changes nothing."""
    k = spec_kernel()
    batch = Batch([1, 1, 300], [50, 4000, 20], decode_threshold=8)
    small = k.step_fn(k.params, k.batch_arrays(batch, bucket=16))
    large = k.step_fn(k.params, k.batch_arrays(batch, bucket=256))
    assert float(small.no_overlap_s) == float(large.no_overlap_s)
    assert float(small.expected_s) == float(large.expected_s)


# -- properties of step pricing (§4.4) -------------------------------------------------------

def test_dcp_halves_the_decode_read(spec_repos):
    """§4.4.1: (HBM(1) − HBM(2)) / (HBM(2) − HBM(4)) = 2 on deepseek-v3, tp 8."""
    batch = Batch([1] * 32, [32767] * 32, decode_threshold=8)
    hbm = []
    for dcp in (1, 2, 4):
        b = bundle("deepseek-v3", tp=8, quantization="fp8", cache_dtype="fp8",
                   block_size=16, max_model_len=32768)
        b[1]["pools"][0]["parallel"]["dcp"] = dcp
        hbm.append(open_spec(b, spec_repos).step_time(batch).per_resource_s["hbm"])
    assert (hbm[0] - hbm[1]) / (hbm[1] - hbm[2]) == pytest.approx(2.0, abs=1e-6)


def test_context_growth_adds_exactly_the_read():
    """§4.4.2: Δ context on one decode adds L_kv·Δ·bpt/r_dec to HBM."""
    k = spec_kernel()
    a = k.step_time(Batch([1] * 4, [1000] * 4, decode_threshold=8))
    b = k.step_time(Batch([1] * 4, [1000, 1000, 1000, 1777], decode_threshold=8))
    assert b.per_resource_s["hbm"] - a.per_resource_s["hbm"] == \
        pytest.approx(61 * 777 * 576 / 2784000e6, rel=1e-9)


def test_inflating_one_collective_floor():
    """§4.4.3: floor × 10 adds exactly 9 floors per launch to NVLink and NoOverlap."""
    k = spec_kernel()
    key = k.plan.key("all_reduce", "TP")
    base = k.step_time(DSV3_BATCH)
    up = k.with_params(k.params.scaled(**{key.floor: 10.0})).step_time(DSV3_BATCH)
    nine = 9 * 15.98e-6 * 122
    assert up.per_resource_s["nvlink"] - base.per_resource_s["nvlink"] == pytest.approx(nine, rel=1e-9)
    assert up.no_overlap_s - base.no_overlap_s == pytest.approx(nine, rel=1e-9)
    for r in ("sm", "hbm", "host", "nic"):
        assert up.per_resource_s[r] == base.per_resource_s[r]


def test_sliding_window_reads_only_the_window(spec_repos):
    """§4.4.5 / D3: on gpt-oss-120b only the 18 full layers read the longer context."""
    k = open_spec(bundle("gpt-oss-120b", tp=8), spec_repos)
    short = k.step_time(Batch([1] * 8, [2047] * 8, decode_threshold=8))
    long = k.step_time(Batch([1] * 8, [4095] * 8, decode_threshold=8))
    bpt = k.plan.bpt_layer
    assert long.per_resource_s["hbm"] - short.per_resource_s["hbm"] == \
        pytest.approx(18 * 8 * 2048 * bpt / 2784000e6, rel=1e-9)


def _hbm_dependence_on_decode_floor(k, batch):
    lo = k.with_params(k.params.replace(attention_decode_floor=0.0)).step_time(batch)
    return k.step_time(batch).per_resource_s["hbm"] - lo.per_resource_s["hbm"]


def test_single_launch_rule(spec_repos):
    """§4.4.6 / D4: a mixed batch on h200 gqa drops the decode floor (f_dec ≤ f_p) from HBM;
    on Blackwell, or on an MLA model, nothing is removed."""
    mixed = Batch([1, 1, 200], [500, 700, 0], decode_threshold=8)
    decode_only = Batch([1, 1], [500, 700], decode_threshold=8)
    k = open_spec(bundle("tiny-llm"), spec_repos)
    L = k.plan.total_layers
    assert _hbm_dependence_on_decode_floor(k, mixed) == pytest.approx(0.0, abs=1e-15)
    assert _hbm_dependence_on_decode_floor(k, decode_only) == pytest.approx(L * 11e-6, rel=1e-9)
    kb = open_spec(bundle("tiny-llm", chip="b200"), spec_repos)
    assert _hbm_dependence_on_decode_floor(kb, mixed) == pytest.approx(L * 11e-6, rel=1e-9)
    mla = spec_kernel()
    assert _hbm_dependence_on_decode_floor(mla, mixed) == pytest.approx(61 * 11e-6, rel=1e-9)
    # when the prefill floor is the smaller one, it is the one removed (from SM)
    low_fp = k.with_params(k.params.replace(attention_prefill_floor=5e-6))
    assert _hbm_dependence_on_decode_floor(low_fp, mixed) == pytest.approx(L * 11e-6, rel=1e-9)


def test_sm_budget_derates_flop_time_only():
    """step.md §5: sm_budget 66 of 132 SMs doubles FLOP-derived SM time, not floors or HBM."""
    k = spec_kernel()
    batch = Batch([1] * 32, [4095] * 32, decode_threshold=8)
    full = k.step_time(batch)
    half = k.step_time(Batch([1] * 32, [4095] * 32, decode_threshold=8, sm_budget=66))
    assert half.per_resource_s["sm"] == pytest.approx(2 * full.per_resource_s["sm"], rel=1e-12)
    assert half.per_resource_s["hbm"] == full.per_resource_s["hbm"]
    same = k.step_time(Batch([1] * 32, [4095] * 32, decode_threshold=8, sm_budget=500))
    assert same == full
