"""The methods around a step (spec methods.md; vectors.md §5).

Values are checked in nanoseconds to the tolerance the vectors state (±1 ns). The fixture
registry holds the public host values (0.35 µs per admitted token, 45.9 µs per output token,
777.3 µs per completion, no per-request admission term) and a 64,000 B/µs host link.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import jkernel
from conftest import spec_kernel
from jkernel import Placement
from jkernel import overheads

SPEC = Path(__file__).resolve().parent / "data" / "spec_catalog"
SPEC_REPOS = jkernel.Repos(catalog=SPEC, registry=SPEC)
SCENARIO = SPEC / "scenarios" / "deepseek-v3-h200-fp8-tp8.yaml"


def ns(seconds: float) -> float:
    return seconds * 1e9


def _bundle(**cluster):
    """The vectors.md §4.1 scenario with cluster (and pool) changes."""
    import yaml

    sc, dep = yaml.safe_load_all(SCENARIO.read_text())
    sc["cluster"].update(cluster)
    dep["pools"][0]["nodes"] = sc["cluster"]["nodes"]
    return sc, dep


@pytest.fixture(scope="module")
def k():
    return spec_kernel()


@pytest.fixture(scope="module")
def k_fabric():
    """vectors.md §4.1 with `cluster.fabric: ib-400g` stated, so a cross-node transfer uses
    the NIC."""
    return jkernel.open(_bundle(fabric="ib-400g"), SPEC_REPOS)


# -- host terms (methods.md §1–§3) -------------------------------------------------------------

def test_admission_overhead(k):
    """vectors.md §5 [S]: admission_overhead(1000) = 1000·0.35 µs = 350,000 ns (±1); zero or
    with no per-request entry the term is 0 (recorded absent). A negative count is refused
    (see test_methods_refuse_bad_arguments)."""
    assert ns(k.admission_overhead(1000)) == pytest.approx(350_000, abs=1)
    assert k.admission_overhead(0) == 0.0
    assert ns(k.admission_overhead(1)) == pytest.approx(350, abs=1)
    assert k.assumption("host_admission_per_request").startswith("absent")


def test_output_token_and_completion(k):
    """vectors.md §5 [S]: 45,900 ns per output token, 777,300 ns per completion (±1)."""
    assert ns(k.output_token_overhead()) == pytest.approx(45_900, abs=1)
    assert ns(k.completion_overhead()) == pytest.approx(777_300, abs=1)


def test_api_server_work_is_zero_by_default_and_follows_the_constants(k):
    """The API server's work (jkernel's own, for the replay's queue): 0 where the catalog
    has no entry (recorded as jkernel's default), else the constants in seconds; a NaN or
    negative value is 0 (to_s), jitted as unjitted."""
    assert k.api_server_work() == (0.0, 0.0)
    assert k.assumption("host_api_server_per_token").startswith("0")
    p = k.params.replace(host_api_server_per_request=5e-3, host_api_server_per_token=150e-6)
    assert k.with_params(p).api_server_work() == pytest.approx((5e-3, 150e-6))
    both = jax.jit(lambda q: (overheads.api_server_request_time(q),
                              overheads.api_server_token_time(q)))
    assert [float(x) for x in both(p)] == pytest.approx([5e-3, 150e-6])
    bad = k.params.replace(host_api_server_per_request=float("nan"),
                           host_api_server_per_token=-1.0)
    assert [float(x) for x in both(bad)] == [0.0, 0.0]


def _with_admission_per_request(us: float) -> jkernel.Kernel:
    """The vectors.md §4.1 kernel with a ``host_admission_per_request`` entry of ``us``."""
    from jkernel.documents import CoefficientSet, Entry, Scope

    inputs = jkernel.open_inputs(SCENARIO, SPEC_REPOS)
    extra = CoefficientSet("extra", (Entry("host_admission_per_request", us,
                                           "us_per_request", "assumed", False,
                                           Scope(hardware=("h200",)), rationale="test"),))
    return jkernel.new(dataclasses.replace(
        inputs, coefficient_sets=inputs.coefficient_sets + (extra,)))


def test_admission_per_request_term():
    """methods.md §1: (per_request + per_token·tokens)·1e-6, when the per-request entry
    exists."""
    k2 = _with_admission_per_request(100.0)
    assert ns(k2.admission_overhead(1000)) == pytest.approx(450_000, abs=1)
    assert k2.admission_overhead(0) == 0.0


@pytest.mark.parametrize("per_request", [False, True])
def test_admission_overheads_are_the_scalar_figures_of_each_prompt(per_request):
    """Kernel.admission_overheads prices many prompts in one call (the replay primes its
    workload's prompt lengths with it): each entry is admission_overhead of that prompt,
    to the bit, zero included, with and without a per-request term; a negative or
    fractional count, or a table, is refused as the scalar method refuses it."""
    import numpy as np

    k2 = _with_admission_per_request(123.4) if per_request else spec_kernel()
    prompts = [0, 1, 7, 1000, 4097, 131_072, 2**31 - 1]
    got = k2.admission_overheads(prompts)
    assert got.dtype == np.float64 and got.shape == (len(prompts),)
    assert got.tolist() == [k2.admission_overhead(p) for p in prompts]
    assert k2.admission_overheads(np.array([], np.int32)).shape == (0,)
    for bad in ([-1], [1.5], [[1, 2]]):
        with pytest.raises(jkernel.ArgumentError, match="prompt_tokens"):
            k2.admission_overheads(bad)


def test_admission_gradient_is_finite():
    """The methods are pure functions of the Params pytree: jax.grad of admission_overhead
    over it is finite everywhere, with d/d(per token) = prompt tokens and d/d(per request) = 1
    (both in seconds), and 0 for every other leaf."""
    k = spec_kernel()
    grads = jax.grad(lambda p: overheads.admission_overhead(p, 1000))(k.params)
    assert isinstance(grads, jkernel.Params) and set(grads) == set(k.params)
    assert all(bool(jnp.isfinite(g)) for g in grads.values())
    assert float(grads["host_admission_per_token"]) == pytest.approx(1000.0)
    assert float(grads["host_admission_per_request"]) == pytest.approx(1.0)
    others = [n for n in grads if not n.startswith("host_admission")]
    assert all(float(grads[n]) == 0.0 for n in others)
    g0 = jax.grad(lambda p: overheads.admission_overhead(p, 0))(k.params)
    assert all(float(g) == 0.0 for g in g0.values())


def test_transfer_gradients_are_finite(k):
    """The PD and tier transfers differentiate too (rates and floors are pytree leaves)."""
    g = jax.grad(lambda p: overheads.pd_transfer_time(
        p, 4096, kv_bytes_per_token=35_136.0, same_node=False, same_rack_domain=False,
        floor_name=None))(k.params)
    assert all(bool(jnp.isfinite(x)) for x in g.values())
    assert float(g["nic_bytes_per_s"]) < 0
    dev = k.inputs.devices["cpu_dram"]
    g = jax.grad(lambda p: overheads.tier_time(p, dev, "from_tier", 2.0 ** 30, 1))(k.params)
    assert all(bool(jnp.isfinite(x)) for x in g.values())


# -- PD transfer (methods.md §4, D26) ---------------------------------------------------------

def test_pd_transfer_across_nodes_on_ib_400g(k_fabric):
    """vectors.md §5 [S]: 4096 tokens of deepseek-v3 with an fp8 cache are 4096·35,136 =
    143,917,056 B; across nodes on ib-400g (50 GB/s) that is 2,878,341 ns (±1)."""
    t = k_fabric.pd_transfer_time(4096, Placement(node=0), Placement(node=1))
    assert ns(t) == pytest.approx(2_878_341, abs=1)
    assert t == pytest.approx(143_917_056 / 50e9, rel=1e-12)


def test_pd_transfer_on_one_node(k_fabric, k):
    """vectors.md §5 [S]: both ends on one node go at the h200 NVLink rate, 450 GB/s:
    319,815 ns (±1). Without a fabric the NIC rate is the NVLink rate (resolution.md §2)."""
    same = k_fabric.pd_transfer_time(4096, Placement(node=3), Placement(node=3))
    assert ns(same) == pytest.approx(319_815, abs=1)
    assert ns(k.pd_transfer_time(4096, Placement(node=0), Placement(node=1))) == \
        pytest.approx(319_815, abs=1)


def test_pd_transfer_zero_tokens(k_fabric):
    """vectors.md §5: pd_transfer_time(0, …) = 0 (a negative count is refused:
    see test_methods_refuse_bad_arguments)."""
    assert k_fabric.pd_transfer_time(0, Placement(0), Placement(1)) == 0.0


def test_pd_transfer_is_not_divided_by_dcp():
    """methods.md §4: nbytes = tokens·kvB, not divided by dcp and not paged."""
    kd = jkernel.open(_bundle(fabric="ib-400g"), SPEC_REPOS)
    sc, dep = _bundle(fabric="ib-400g")
    dep["pools"][0]["parallel"]["dcp"] = 2
    kdcp = jkernel.open((sc, dep), SPEC_REPOS)
    a = kd.pd_transfer_time(1000, Placement(0), Placement(1))
    assert kdcp.pd_transfer_time(1000, Placement(0), Placement(1)) == a
    assert a == pytest.approx(1000 * 35_136 / 50e9, rel=1e-12)   # 1000 is not a page multiple


def test_pd_transfer_floor_is_the_expert_alltoall_t0():
    """methods.md §4: the floor is t0 of the (alltoall, Expert) key: 15.98 µs for an 8-rank
    expert group on h200, which binds for one token."""
    sc, dep = _bundle(fabric="ib-400g")
    dep["pools"][0]["parallel"]["enable_expert_parallel"] = True
    kep = jkernel.open((sc, dep), SPEC_REPOS)
    assert ns(kep.pd_transfer_time(1, Placement(0), Placement(1))) == pytest.approx(15_980,
                                                                                   abs=1)


def test_pd_transfer_inside_a_rack_domain_uses_nvlink():
    """methods.md §4: across nodes of one rack-wide NVLink domain (GB200 NVL72) the rate is
    NVLink (900 GB/s); across racks it is the fabric's."""
    sc, dep = _bundle(fabric="ib-400g", hardware="gb200-nvl72", gpus_per_node=4, nodes=2)
    sc["coefficients"] = ["spec-chips"]
    dep["pools"][0]["parallel"]["tp"] = 4
    kg = jkernel.open((sc, dep), SPEC_REPOS)
    nbytes = 4096 * 35_136
    assert kg.pd_transfer_time(4096, Placement(0, rack=0), Placement(1, rack=0)) == \
        pytest.approx(nbytes / 900e9, rel=1e-12)
    assert kg.pd_transfer_time(4096, Placement(0, rack=0), Placement(1, rack=1)) == \
        pytest.approx(nbytes / 50e9, rel=1e-12)


# -- tier time (methods.md §5, D25) --------------------------------------------------------------

@pytest.mark.parametrize("tier, direction, nbytes, depth, expect_ns", [
    ("cpu_dram", "from_tier", 2 ** 30, 1, 53_687_091),     # min(20e9, 64e9) = 20 GB/s
    ("cpu_dram", "from_tier", 2 ** 30, 4, 214_748_364),    # linear sharing at depth 4
    ("cpu_dram", "to_tier", 0, 1, 1_000),                  # the base latency, 1 µs
    ("nvme_gen4", "to_tier", 10 ** 9, 1, 200_000_000),     # write 5 GB/s
    ("nvme_gen4", "from_tier", 7 * 10 ** 9, 1, 1_000_000_000),   # read 7 GB/s
    ("s3", "from_tier", 1, 1, 30_000_000),                 # the floor binds
])
def test_tier_time(k, tier, direction, nbytes, depth, expect_ns):
    """vectors.md §5 [S]: tier_time with host_link_bandwidth 64,000 B/µs. Every storage
    class of the catalog is a known tier, though the deployment lists none (D25)."""
    assert ns(k.tier_time(tier, direction, nbytes, depth)) == pytest.approx(expect_ns, abs=1)


def test_unknown_tier_is_the_largest_duration(k):
    """vectors.md §5: an unknown tier costs 2⁶³ − 1 ns ('largest representable duration')."""
    t = k.tier_time("tape", "from_tier", 1, 1)
    assert t == pytest.approx((2 ** 63 - 1) * 1e-9, rel=1e-15)
    assert k.tier_time("tape", "to_tier", 0, 1) == t


def test_tier_time_host_link_cap():
    """methods.md §5: the rate is the slower of device and host link; with no host link entry
    there is no cap."""
    inputs = jkernel.open_inputs(SCENARIO, SPEC_REPOS)

    def with_link(value):
        from jkernel.documents import Entry, Scope

        sets = []
        for cs in inputs.coefficient_sets:
            entries = tuple(e for e in cs.entries if e.name != "host_link_bandwidth")
            if value is not None:
                entries += (Entry("host_link_bandwidth", value, "bytes_per_us", "assumed",
                                  False, Scope(hardware=("h200",)), rationale="test"),)
            sets.append(dataclasses.replace(cs, entries=entries))
        return jkernel.new(dataclasses.replace(inputs, coefficient_sets=tuple(sets)))

    capped = with_link(10_000.0)                     # 10 GB/s, below DRAM's 20 GB/s
    assert capped.tier_time("cpu_dram", "from_tier", 2 ** 30) == \
        pytest.approx(2 ** 30 / 10e9, rel=1e-12)
    uncapped = with_link(None)
    assert uncapped.tier_time("cpu_dram", "from_tier", 2 ** 30) == \
        pytest.approx(2 ** 30 / 20e9, rel=1e-12)


def test_tier_time_rejects_an_unknown_direction(k):
    with pytest.raises(ValueError):
        k.tier_time("cpu_dram", "sideways", 1, 1)


def test_methods_return_float_seconds(k):
    """README conventions: durations are float64 seconds, finite for known paths."""
    for v in (k.admission_overhead(10), k.output_token_overhead(), k.completion_overhead(),
              k.pd_transfer_time(10, Placement(0), Placement(1)),
              k.tier_time("sata_ssd", "to_tier", 1e6, 2)):
        assert isinstance(v, float) and math.isfinite(v) and v >= 0


# -- one validation for every entry point: each call below used to return a
# silent 0 / 1e-6 or fail with a raw AttributeError; now each names its argument.

@pytest.mark.parametrize("call,argument", [
    (lambda k: k.admission_overhead(-5), "prompt_tokens"),              # returned 0
    (lambda k: k.admission_overhead(float("nan")), "prompt_tokens"),    # returned 0
    (lambda k: k.admission_overhead(2.5), "prompt_tokens"),
    (lambda k: k.pd_transfer_time(-4096, Placement(0), Placement(1)), "tokens"),  # returned 0
    (lambda k: k.pd_transfer_time(4096, 0, 1), "src"),                  # raw AttributeError
    (lambda k: k.pd_transfer_time(4096, Placement(0), None), "dst"),
    (lambda k: k.tier_time("cpu_dram", "to_tier", -1), "nbytes"),       # returned 1e-6
    (lambda k: k.tier_time("cpu_dram", "to_tier", float("inf")), "nbytes"),
    (lambda k: k.tier_time("cpu_dram", "to_tier", 10, 0), "queue_depth"),
    (lambda k: k.tier_time("cpu_dram", "sideways", 10), "direction"),
])
def test_methods_refuse_bad_arguments(k, call, argument):
    with pytest.raises(jkernel.ArgumentError) as info:
        call(k)
    assert info.value.argument == argument
    assert str(info.value).startswith(argument)
