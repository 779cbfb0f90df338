"""The compiled programs of a kernel structure (jkernel/programs.py): shared per structure,
the packed input and output layouts, and the single step as one program or two."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jkernel
from jkernel.programs import (PACKED_FIELDS, SMALL_PACKED, Programs, estimate_of,
                              estimates_of, packed_batch, programs)
from jkernel.stages import RESOURCES, Resources

from conftest import catalog_kernel


def _programs(k) -> Programs:
    return programs(k.plan, k.options, tuple(k.params))


def _flat(k, p: Programs):
    """The kernel's params packed in the programs' order."""
    return jnp.stack([jnp.asarray(k.params[n]) for n in p.names])


def _packed(s, c, thr=1, budget=0, pad=0, width=None) -> np.ndarray:
    width = width or len(s)
    out = np.zeros(2 * width + 3, np.int32)
    out[:len(s)], out[width:width + len(c)] = s, c
    out[-3:] = thr, budget, pad
    return out


def test_programs_are_shared_per_structure():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = _programs(k)
    assert p is programs(k.plan, k.options, tuple(k.params)) and k.step_fn is p.step_fn
    other = k.with_params(k.params.scaled(hbm_derate=0.5))
    assert _programs(other) is p and other.step_fn is p.step_fn
    assert isinstance(p, Programs) and p.names == tuple(k.params)
    assert programs(k.plan, jkernel.StepOptions(smooth_temperature=0.01),
                    tuple(k.params)) is not p


def test_packed_batch_reads_the_layout():
    b = packed_batch(_packed([3, 1, 0], [7, 8, 9], thr=2, budget=66, pad=4))
    assert b.scheduled.tolist() == [3, 1, 0] and b.computed.tolist() == [7, 8, 9]
    assert b.mask.tolist() == [True, True, False]
    assert (int(b.decode_threshold), int(b.sm_budget), int(b.pad_tokens)) == (2, 66, 4)


def test_packed_output_columns_name_the_estimate():
    assert PACKED_FIELDS == ("overlap_s", "no_overlap_s", "expected_s",
                             *(f"{r}_s" for r in RESOURCES), "bottleneck")
    row = [0.5, 0.9, 0.7, 0.1, 0.2, 0.3, 0.4, 0.05, 3.0]
    one = estimate_of(row)
    assert (one.overlap_s, one.no_overlap_s, one.expected_s) == (0.5, 0.9, 0.7)
    assert one.per_resource_s == Resources(0.1, 0.2, 0.3, 0.4, 0.05)
    assert one.bottleneck == 3 and one.bottleneck_name == "nic"
    many = estimates_of(np.array([row, row]))
    assert many.per_resource_s.nic.tolist() == [0.4, 0.4]
    assert many.bottleneck.dtype == np.int32


@pytest.mark.parametrize("scenario, split", [("llama-3.1-8b-h100-tp1", True),
                                             ("glm-5-h200-2node-pcp2-dcp2", False)])
def test_single_step_splits_from_the_plans_lanes(scenario, split):
    """A step whose input exceeds SMALL_PACKED runs as the request reduction then the step
    from the sums, the vector laid out by the plan's lanes spec (its lanes, the sign
    check, then the three scalars); the figures equal the one program's to the bit. A plan
    that reads the requests after the reduction stays one program."""
    k = catalog_kernel(scenario)
    p = Programs(k.plan, k.options, tuple(k.params))          # fresh: nothing traced yet
    rng = np.random.default_rng(3)
    n = 100
    packed = _packed(np.where(rng.random(n) < 0.7, 1, rng.integers(2, 500, n)),
                     rng.integers(0, 20000, n), pad=2, width=256)
    assert packed.shape[-1] > SMALL_PACKED and p.split is None
    flat = _flat(k, p)
    got = p.step(flat, packed)
    assert p.split is split
    want = np.asarray(p.one(flat, packed))
    assert got.tolist() == want.tolist()
    if split:
        vec = p.reduce_requests(packed, flat.dtype)
        assert vec.shape == (p.step_fn.lanes.size(check=True) + 3,)


def test_sign_check_is_the_last_packed_column():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = _programs(k)
    for width in (16, 256):                       # one program, and the split path
        packed = _packed([1, -2, 5], [4, 0, -1], width=width)
        assert p.step(_flat(k, p), packed)[-1] == 2


def test_traces_count_new_programs_only():
    """A bucket traces once; the split's second program is one for every bucket."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = Programs(k.plan, k.options, tuple(k.params))
    flat = _flat(k, p)
    p.step(flat, _packed([1, 2], [3, 4], width=16))
    n = p.traces
    p.step(flat, _packed([5, 1], [0, 9], width=16))
    assert p.traces == n == 1
    p.step(flat, _packed([5, 1], [0, 9], width=64))    # split: the reduction + the rest
    assert p.traces == 3
    p.step(flat, _packed([5, 1], [0, 9], width=256))   # the rest is shared by buckets
    assert p.traces == 4


def test_jitted_step_equals_the_step_function():
    k = catalog_kernel("nemotron-3-super-120b-a12b-b200-tp2-mtp")
    arrays = k.batch_arrays(jkernel.Batch.from_spec("8x2@500,1x300@0"))
    p = _programs(k)
    a, b = p.step_fn(k.params, arrays), p.jit_step(k.params, arrays)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-12, atol=0)
    packed = p.one(_flat(k, p), _packed([2] * 8 + [300], [500] * 8 + [0], width=16))
    assert np.asarray(packed)[:8].tolist() == pytest.approx(
        [float(a.overlap_s), float(a.no_overlap_s), float(a.expected_s),
         *(float(v) for v in a.per_resource_s)], rel=1e-12)


def test_gradient_program_differentiates_one_column():
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    packed = _packed([1] * 8, [2000] * 8)
    p = _programs(k)
    value, g = p.grad(PACKED_FIELDS.index("hbm_s"))(_flat(k, p), packed)
    assert float(value) == pytest.approx(float(p.step(_flat(k, p), packed)[4]), rel=1e-12)
    names = list(p.names)
    assert float(g[names.index("hbm_bytes_per_s")]) < 0


def test_small_single_step_has_no_reducer():
    """The one-program step sums its requests and picks its bottleneck without a reduction
    (XLA's CPU runtime allocates a reducer's buffers on every run, which cost a 1-request
    step more than its arithmetic); its figures equal the bulk program's, which keeps the
    reduction, to the bit."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    p = _programs(k)
    flat = _flat(k, p)
    packed = _packed([1, 1, 700, 0, 1], [40, 9000, 0, 5, 123], pad=3, width=16)
    assert packed.shape[-1] <= SMALL_PACKED
    hlo = p.one.lower(flat, packed).compile().as_text()
    assert " reduce(" not in hlo and "reduce-window" not in hlo
    b = packed_batch(packed)
    rows, negative = p.many(flat, b.scheduled[None], b.computed[None],
                            packed[None, -3:])
    assert np.asarray(p.one(flat, packed))[:-1].tobytes() == np.asarray(rows)[0].tobytes()


def test_float32_single_step_equals_the_bulk_program_to_the_bit():
    """In float32 XLA's CPU compiler sums a row in vector lanes, not the serial chain the
    written-out sum follows: a float32 single step keeps the reduction, so its figures
    equal the bulk program's to the bit (the written-out sum differed in the last bit)."""
    k = catalog_kernel("llama-3.1-8b-h100-tp1")
    k32 = k.with_params(k.params.astype(jnp.float32))
    p = _programs(k32)
    flat = _flat(k32, p)
    assert flat.dtype == jnp.float32
    for seed in range(40, 60):          # some of these differed in the last bit
        rng = np.random.default_rng(seed)
        n = 16 if seed % 4 else 9
        s = np.where(rng.random(n) < 0.4, rng.integers(2, 9000, n), 1)
        s = np.where(rng.random(n) < 0.1, 0, s).astype(np.int32)
        c = rng.integers(0, 70000, n).astype(np.int32)
        packed = _packed(s, c, pad=seed % 3, width=16)
        b = packed_batch(packed)
        rows, _ = p.many(flat, b.scheduled[None], b.computed[None], packed[None, -3:])
        row = np.asarray(rows)[0]
        assert np.asarray(p.one(flat, packed))[:-1].tobytes() == row.tobytes()
        est = k32.step_time(scheduled=s, computed=c, decode_threshold=1, pad_tokens=seed % 3)
        assert [est.overlap_s, est.no_overlap_s, est.expected_s] == row[:3].tolist()


@pytest.mark.parametrize("values", [[1.0, 3.0, 3.0, 2.0, 0.0], [0.0] * 5,
                                    [1.0, np.nan, 5.0, np.nan, 0.0], [-0.0, 0.0, 0.0, 1, 1],
                                    [np.inf, 1.0, np.inf, 0.0, 2.0]])
def test_bottleneck_is_the_first_largest_resource(values):
    """The written-out bottleneck equals ``argmax``: the first largest, the first NaN."""
    from jkernel.step import _first_max

    got = jax.jit(lambda v: _first_max(list(v)))(jnp.asarray(values))
    assert int(got) == int(np.argmax(np.asarray(values)))
    rows = jnp.asarray([values, values[::-1]])
    got = jax.jit(lambda r: _first_max([r[:, i] for i in range(5)]))(rows)
    assert np.asarray(got).tolist() == np.argmax(np.asarray(rows), axis=1).tolist()
