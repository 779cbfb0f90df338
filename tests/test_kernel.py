"""The Kernel's calling surface: batches, buckets, bulk pricing, sweeps, gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkernel
from jkernel import Batch, StepOptions
from conftest import catalog_kernel, spec_kernel


# -- Batch validation (before anything is traced) --------------------------------------------

@pytest.mark.parametrize("kwargs,match", [
    (dict(scheduled=[1, -2], computed=[0, 0]), "≥ 0"),
    (dict(scheduled=[1.5], computed=[0]), "whole token"),
    (dict(scheduled=[1, 2], computed=[0]), "entries"),
    (dict(scheduled=[1], computed=[float("nan")]), "NaN"),
    (dict(scheduled=[[1]], computed=[[0]]), "one-dimensional"),
    (dict(scheduled=["a"], computed=[0]), "integers"),
])
def test_batch_rejects_bad_tokens(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Batch(kwargs["scheduled"], kwargs["computed"])


def test_batch_defaults_and_spec_notation():
    b = Batch.from_spec("2x1@4096,1x2048@0")
    assert list(b.scheduled) == [1, 1, 2048] and list(b.computed) == [4096, 4096, 0]
    assert b.decode_threshold == 1 and b.pad_tokens == 0           # D27
    assert Batch([1], [0], pad_tokens=-5).pad_tokens == 0          # negative pad counts as 0
    with pytest.raises(ValueError, match="NxS@C"):
        Batch.from_spec("32 decodes")
    assert len(Batch.of([jkernel.Request(1, 10), (4, 0)])) == 2


def test_empty_batch_with_pad_is_a_valid_step():
    est = spec_kernel().step_time(Batch([], [], pad_tokens=32))
    assert est.no_overlap_s > est.per_resource_s["host"] > 0


# -- buckets and compilation -------------------------------------------------------------------

def test_no_recompile_within_a_bucket():
    """Recompilation guard: 200 batches of varying size in one bucket trace once."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    k.step_time(Batch([1], [10]))                    # compile the 16-request bucket
    before = k.trace_count
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 17))
        k.step_time(Batch(rng.integers(1, 9, n), rng.integers(0, 5000, n), decode_threshold=8,
                          pad_tokens=int(rng.integers(0, 4))))
    assert k.trace_count == before


def test_with_params_shares_compiled_programs():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    k.step_time(Batch([1], [10]))
    before = k.trace_count
    k2 = k.with_params(k.params.scaled(hbm_derate=0.5))
    est = k2.step_time(Batch([1], [10]))
    assert k2.trace_count == before
    assert est.per_resource_s["hbm"] > k.step_time(Batch([1], [10])).per_resource_s["hbm"]


def test_warm_up_compiles_each_bucket_once():
    k = jkernel.open("llama-3.1-8b-h100-tp1", buckets=(8, 32))
    k.warm_up()
    traced = k.trace_count
    assert traced >= 2
    for n in (1, 7, 8, 9, 31, 32):
        k.step_time(Batch([1] * n, [5] * n))
    assert k.trace_count == traced


# -- bulk pricing and sweeps -------------------------------------------------------------------

def test_price_many_array_form_matches_step_time():
    k = catalog_kernel("mixtral-8x7b-h100-tp2")
    rng = np.random.default_rng(1)
    sched = rng.integers(0, 4, (37, 20))
    sched[:, 0] = 600                          # one prefill per batch
    comp = rng.integers(0, 9000, (37, 20))
    est = k.price_many(scheduled=sched, computed=comp, decode_threshold=3, chunk=16)
    assert est.no_overlap_s.shape == (37,)
    for j in (0, 15, 16, 36):
        one = k.step_time(Batch(sched[j], comp[j], decode_threshold=3))
        assert est.no_overlap_s[j] == pytest.approx(one.no_overlap_s, rel=1e-12)
        assert est.expected_s[j] == pytest.approx(one.expected_s, rel=1e-12)
        assert est.per_resource_s["hbm"][j] == pytest.approx(one.per_resource_s["hbm"],
                                                             rel=1e-12)


def test_price_many_rejects_bad_arrays():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    with pytest.raises(ValueError, match="shape"):
        k.price_many(scheduled=np.ones(5), computed=np.ones(5))
    with pytest.raises(ValueError, match="≥ 0"):
        k.price_many(scheduled=-np.ones((2, 3)), computed=np.ones((2, 3)))


def test_price_sweep_over_parameter_sets():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    sets = [k.params, k.params.scaled(hbm_bytes_per_s=1.2), k.params.scaled(hbm_bytes_per_s=0.8)]
    sched = np.ones((5, 16), int)
    comp = np.full((5, 16), 2048)
    out = k.price_sweep(sets, scheduled=sched, computed=comp)
    assert out.no_overlap_s.shape == (3, 5)
    base = k.price_many(scheduled=sched, computed=comp)
    np.testing.assert_allclose(out.no_overlap_s[0], base.no_overlap_s, rtol=1e-12)
    assert np.all(out.per_resource_s["hbm"][1] < out.per_resource_s["hbm"][0])
    assert np.all(out.per_resource_s["hbm"][2] > out.per_resource_s["hbm"][0])


# -- gradients -----------------------------------------------------------------------------------

GRAD_BATCHES = [Batch(), Batch([0, 0], [0, 7]), Batch([], [], pad_tokens=8),
                Batch([1] * 8, [4095] * 8, decode_threshold=8),
                Batch([1, 1, 700, 0], [10, 0, 0, 0], decode_threshold=8),
                Batch([1], [0])]


@pytest.mark.parametrize("name", ["llama-3.1-70b-h100-tp4", "deepseek-v3-h200-fp8-tp8",
                                  "qwen3-30b-a3b-h200-ep"])
@pytest.mark.parametrize("field", ["no_overlap_s", "expected_s"])
def test_gradients_are_finite_everywhere(name, field):
    """Empty batches, zero-token requests, pad-only steps and ties: no NaN or inf."""
    k = catalog_kernel(name)
    grad = jax.jit(jax.grad(lambda p, b: getattr(k.step_fn(p, b), field)))
    for batch in GRAD_BATCHES:
        g = grad(k.params, k.batch_arrays(batch))
        bad = [n for n, v in g.items() if not np.isfinite(float(v))]
        assert not bad, f"non-finite gradient for {bad} on {batch}"


def test_gradient_at_a_resource_tie_is_finite():
    k = spec_kernel()
    batch = k.batch_arrays(Batch([1] * 8, [1000] * 8, decode_threshold=8))
    est = k.step_fn(k.params, batch)
    # force an exact tie between SM and HBM by scaling the peak
    scale = float(est.per_resource_s["sm"] / est.per_resource_s["hbm"])
    tied = k.params.scaled(peak_flops_per_s=scale)
    g = jax.grad(lambda p: k.step_fn(p, batch).overlap_s)(tied)
    assert all(np.isfinite(float(v)) for v in g.values())


def test_smooth_max_is_opt_in_and_tends_to_the_spec():
    k = spec_kernel()
    batch = Batch([1] * 32, [4095] * 32, decode_threshold=8)
    hard = k.step_time(batch)
    assert k.options.smooth_temperature == 0.0
    near = k.with_options(StepOptions(smooth_temperature=1e-4)).step_time(batch)
    soft = k.with_options(StepOptions(smooth_temperature=0.05)).step_time(batch)
    assert near.overlap_s == pytest.approx(hard.overlap_s, rel=1e-3)
    assert soft.overlap_s > hard.overlap_s
    assert soft.no_overlap_s == pytest.approx(hard.no_overlap_s, rel=1e-12)   # a plain sum


def test_jacfwd_over_every_parameter():
    k = catalog_kernel("llama-3.1-70b-h100-tp4")
    jac = jax.jacfwd(lambda p: k.step_fn(p, k.batch_arrays(Batch([1] * 4, [100] * 4))
                                         ).no_overlap_s)(k.params)
    assert set(jac) == set(k.params)
    assert float(jac["hbm_derate"]) < 0 < float(jac["host_launch_per_kernel"])


def test_float32_params_price_in_float32():
    k = spec_kernel()
    p32 = k.params.astype(jnp.float32)
    est = k.step_fn(p32, k.batch_arrays(Batch([1] * 4, [100] * 4)))
    assert est.no_overlap_s.dtype == jnp.float32
    ref = k.step_time(Batch([1] * 4, [100] * 4))
    assert float(est.no_overlap_s) == pytest.approx(ref.no_overlap_s, rel=1e-5)


def test_price_many_int32_sign_check_names_the_array_in_any_chunk():
    """The sign check of int32 inputs is a lane of the pricing pass (no host pass): a
    negative entry in any chunk, of either array, is refused naming the array and value."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    for name, row in (("scheduled", 0), ("computed", 9), ("scheduled", 6)):
        s, c = np.ones((10, 16), np.int32), np.full((10, 16), 100, np.int32)
        ({"scheduled": s, "computed": c}[name])[row, 3] = -7
        with pytest.raises(ValueError, match=f"{name}: must be ≥ 0, got -7"):
            k.price_many(scheduled=s, computed=c, chunk=4)
        with pytest.raises(ValueError, match=f"{name}: must be ≥ 0, got -7"):
            k.price_sweep([k.params], scheduled=s, computed=c, chunk=4)


def test_price_many_same_prices_for_aligned_unaligned_and_short_chunks():
    """Chunks XLA cannot read in place (not 64-byte aligned, or the short last chunk) are
    copied into reused buffers: the prices do not depend on that, nor on the chunking."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    rng = np.random.default_rng(3)
    s = rng.integers(0, 3, (37, 64)).astype(np.int32)
    s[::5, 0] = 700                                                     # some prefills
    c = rng.integers(0, 9000, (37, 64)).astype(np.int32)
    raw = np.empty(s.size * 2 + 32, np.int32)                          # an odd offset
    off = 1 + (-raw.ctypes.data // 4) % 16
    s_odd = raw[off:off + s.size].reshape(s.shape)
    s_odd[...] = s
    whole = k.price_many(scheduled=s, computed=c, chunk=64)
    for chunk in (5, 16, 37):
        for sched in (s, s_odd):
            got = k.price_many(scheduled=sched, computed=c, chunk=chunk)
            for field in ("overlap_s", "no_overlap_s", "expected_s"):
                np.testing.assert_array_equal(getattr(got, field), getattr(whole, field))
    one = k.step_time(Batch(s[5], c[5]))
    assert whole.expected_s[5] == pytest.approx(one.expected_s, rel=1e-12)


@pytest.mark.parametrize("scenario, split", [("llama-3.1-8b-h100-tp1", True),
                                             ("qwen3-235b-a22b-h200-tp8-dcp2", True),
                                             ("deepseek-v3.2-h200-fp8-tp8-dcp2", False)])
def test_split_single_step_prices_as_the_one_program(scenario, split):
    """From 64 requests up a step runs as the request reduction then the step from its sums
    (XLA's CPU runtime hands a program with buffers over 512 bytes to its thread pool); the
    figures equal the one-program step to the last bit. A GQA DCP plan splits too; a latent
    DCP plan, whose context gather reads the requests after the reduction, falls back to
    the one program."""
    k = catalog_kernel(scenario)
    rng = np.random.default_rng(5)
    for n in (40, 200):
        s = np.where(rng.random(n) < 0.8, 1, rng.integers(2, 900, n)).astype(np.int32)
        c = rng.integers(0, 30000, n).astype(np.int32)
        got = k.step_time(scheduled=s, computed=c, decode_threshold=1, pad_tokens=3)
        packed = k._pack(None, s, c, 1, 0, 3)
        want = np.asarray(k._programs.one(k._flat, packed))
        assert [got.overlap_s, got.no_overlap_s, got.expected_s] == want[:3].tolist()
        assert [got.per_resource_s[r] for r in jkernel.RESOURCES] == want[3:8].tolist()
    assert k._programs.split is split
