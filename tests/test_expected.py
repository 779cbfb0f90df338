"""expected.md's properties of jkernel's own estimate ``expected_s``."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jkernel import Batch, StepOptions
from conftest import catalog_kernel
from test_properties import batches

HOST = ("host_replay_graph_per_step", "host_launch_eager_per_layer", "host_launch_per_kernel",
        "kernel_gap", "host_serial", "host_serial_per_request")
EDGE_OPTIONS = StepOptions(expected_refinements=False, expected_routed_max=False)


def gpu_only(name: str, options: StepOptions):
    """The kernel with every host term and expected.md's gap/serial constants at zero, so that
    ``expected_s`` is its GPU part and the two edges are their GPU parts."""
    k = catalog_kernel(name)
    return k.with_options(options).with_params(k.params.replace(**{h: 0.0 for h in HOST}))


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["llama-3.1-70b-h100-tp4", "deepseek-v3-h200-fp8-tp8",
                        "qwen3-30b-a3b-h200-ep"]), batches())
def test_expected_lies_between_the_edges_with_refinements_off(name, batch):
    """With refinements 1–5 off (and routed experts added as the edges add them),
    overlap ≤ expected ≤ no_overlap: a max of each kernel's two times is sub-additive.

    With ``expected_routed_max`` on, the lower bound cannot hold: the edges add routed compute
    and memory on purpose (step.md §6.11), expected.md takes their max."""
    k = gpu_only(name, EDGE_OPTIONS)
    est = k.step_time(batch)
    assert est.overlap_s <= est.expected_s * (1 + 1e-12)
    assert est.expected_s <= est.no_overlap_s * (1 + 1e-12)


def test_refinements_lower_a_memory_bound_decode():
    """The refinements only remove double counting on a memory-bound decode step."""
    batch = Batch([1] * 32, [4095] * 32)
    edge = gpu_only("llama-3.1-70b-h100-tp4", EDGE_OPTIONS).step_time(batch)
    refined = gpu_only("llama-3.1-70b-h100-tp4", StepOptions()).step_time(batch)
    assert refined.expected_s <= edge.expected_s * 1.01
    assert refined.expected_s < refined.no_overlap_s


def test_logits_only_for_sampled_tokens():
    """Refinement 4: a 4,096-token prefill samples one token; the edges charge 4,096 logits."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    batch = Batch([4096], [0])
    on = k.step_time(batch).expected_s
    off = k.with_options(StepOptions(expected_refinements=False)).step_time(batch).expected_s
    head = 2 * 128256 * 4096 * 4096 / 989.5e12 / 0.9      # ≥ the head's compute at ramp ≤ ε
    assert off - on > 0.5 * head


def test_kernel_gap_and_host_serial_add_as_stated():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    batch = Batch([1] * 8, [1000] * 8)
    base = k.step_time(batch).expected_s
    gap = k.with_params(k.params.replace(kernel_gap=1e-6)).step_time(batch).expected_s
    assert gap - base == pytest.approx(k.plan.total_kernels * 1e-6, rel=1e-9)
    shipped = float(k.params["host_serial"])     # the H100 step-trace fit ships a value
    serial = k.with_params(k.params.replace(host_serial=5e-4)).step_time(batch).expected_s
    assert serial - base == pytest.approx(5e-4 - shipped, rel=1e-9)


def _speculative(num_spec: int):
    import jkernel
    from jkernel import catalog

    text = (catalog.catalog_root() / "scenarios" / "deepseek-v3-h200-fp8-tp8.yaml").read_text()
    if num_spec:
        text = text.replace("      cudagraph_mode: PIECEWISE",
                            "      cudagraph_mode: PIECEWISE\n      speculative: {method: "
                            f"deepseek_mtp, num_spec_tokens: {num_spec}}}")
    return jkernel.open(text)


def test_mtp_draft_layers_are_priced_in_expected_only():
    """The speculator's draft layers are priced in expected_s (one module per draft
    token); the edges keep D7 and leave them out."""
    batch = Batch([2] * 16, [3000] * 16, decode_threshold=2)
    plain, one, two = (_speculative(n) for n in (0, 1, 2))
    assert one.plan.draft_kinds == (("attn_moe", 1),) and plain.plan.draft_kinds == ()
    e0, e1, e2 = (k.step_time(batch) for k in (plain, one, two))
    for field in ("sm", "hbm", "nvlink", "nic"):
        assert e1.per_resource_s[field] == e0.per_resource_s[field]
    assert e0.expected_s < e1.expected_s < e2.expected_s
    # one draft pass costs about one MoE layer of the step: a 61-layer model gains ~1/61
    assert (e1.expected_s - e0.expected_s) / e0.expected_s == pytest.approx(1 / 61, rel=0.5)


# -- the shape-aware decode law and the fused-MoE law in expected_s ---------------------------

def _parts(k, batch, name):
    """``(expected_s part, edge seconds)`` of one named term over all its layers (the
    breakdown; the GPU side is the critical path in these steps)."""
    t = k.breakdown(batch)
    t = t[t["term"] == name]
    return float(t["expected_s"].sum()), float((t["sm_s"] + t["hbm_s"]).sum())


def test_decode_row_floor_prices_rows_in_expected_only():
    """attention_decode_row_floor (and its overlap order) adds the (request, KV head) rows of
    a decode to expected_s's read as jkernel.laws.decode_attention_time does; the edges keep
    step.md §6.3's floor + bytes/rate. With the row floor at 0 (the spec's coefficient set has
    none) expected_s's read is the edge law's."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    k = k.with_params(k.params.replace(attention_decode_row_floor=0.0))
    batch = Batch([1] * 512, [15] * 512)                     # many rows, short contexts
    name = "attention decode read"
    plain = _parts(k, batch, name)
    rows = _parts(k.with_params(k.params.replace(attention_decode_row_floor=3e-8,
                                                 attention_decode_overlap=1.0)), batch, name)
    assert rows[1] == pytest.approx(plain[1])
    layers, heads = 32, 8                                     # Llama-3.1-8B, tp 1
    assert rows[0] - plain[0] == pytest.approx(layers * 512 * heads * 3e-8, rel=1e-9)
    # a larger order hides the rows behind the stream: never above the sum
    hidden = _parts(k.with_params(k.params.replace(attention_decode_row_floor=3e-8,
                                                   attention_decode_overlap=8.0)), batch, name)
    assert plain[0] < hidden[0] < rows[0]


def test_fused_moe_law_in_expected_only():
    """moe_kernel_floor_<s>, moe_m_half and moe_assignment_time price expected_s's routed
    experts by jkernel.laws.routed_expert_time; the edges keep step.md §6.2. All at 0: the
    routed term is max(compute, memory) as before."""
    k = catalog_kernel("mixtral-8x7b-h100-tp2")
    names = [n for n in k.params if n.startswith("moe_kernel_floor_")]
    assert len(names) == 1
    zero = {names[0]: 0.0, "moe_m_half": 0.0, "moe_assignment_time": 0.0}
    base = k.with_params(k.params.replace(**zero))
    batch = Batch([1] * 8, [1000] * 8)
    name = "routed experts"
    before = _parts(base, batch, name)
    floor = _parts(base.with_params(base.params.replace(**{names[0]: 4e-5})), batch, name)
    assert floor[1] == pytest.approx(before[1])
    layers = 32
    assert floor[0] - before[0] == pytest.approx(layers * 4e-5, rel=1e-9)
    # per assignment: 8 tokens × top-2 on every rank (tp 2, EP off)
    per = _parts(base.with_params(base.params.replace(**{names[0]: 1e-12,
                                                         "moe_assignment_time": 1e-8})),
                 batch, name)
    assert per[0] - before[0] == pytest.approx(layers * (16 * 1e-8 + 1e-12), rel=1e-6)
    # a large prefill is compute-bound: the per-expert ramp raises it
    big = Batch([4096], [0])
    flat = _parts(base.with_params(base.params.replace(**{names[0]: 1e-12})), big, name)
    ramp = _parts(base.with_params(base.params.replace(**{names[0]: 1e-12,
                                                          "moe_m_half": 330.0})), big, name)
    assert ramp[0] > flat[0]
