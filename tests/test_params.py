"""The params pytree (jkernel/params.py): SI conversion, pytree order, immutable updates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkernel.params import CHIP_NAMES, Params, si_scale


def test_si_scale_converts_registry_units():
    assert si_scale("collective_floor_all_reduce_fp16_8rank_h200") == 1e-6
    assert si_scale("attention_decode_rate") == 1e6
    assert si_scale("attention_decode_floor") == 1e-6
    assert si_scale("host_link_bandwidth") == 1e6
    assert si_scale("kernel_gap") == si_scale("host_serial") == 1e-6
    assert si_scale("gemm_eps_max_fp8") == 1.0
    for name in CHIP_NAMES:
        assert si_scale(name) == 1.0


def test_leaves_are_ordered_by_name():
    a = Params({"b": jnp.asarray(2.0), "a": jnp.asarray(1.0)})
    leaves, tree = jax.tree_util.tree_flatten(a)
    assert [float(x) for x in leaves] == [1.0, 2.0]
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert dict(back) == dict(a)


def test_params_vmap_over_stacked_sets():
    stacked = jax.tree_util.tree_map(lambda *x: jnp.stack(x),
                                     Params({"x": jnp.asarray(1.0)}), Params({"x": jnp.asarray(3.0)}))
    out = jax.vmap(lambda p: p["x"] * 2)(stacked)
    np.testing.assert_array_equal(np.asarray(out), [2.0, 6.0])


def test_replace_and_scaled_copy_and_refuse_unknown_names():
    p = Params({"x": jnp.asarray(1.0, jnp.float32)})
    q = p.replace(x=5.0)
    assert float(q["x"]) == 5.0 and float(p["x"]) == 1.0
    assert q["x"].dtype == jnp.float32
    assert float(p.scaled(x=3.0)["x"]) == 3.0
    with pytest.raises(KeyError, match="unknown parameter"):
        p.replace(y=1.0)


def test_registry_units_round_trip_and_value_default():
    p = Params({"attention_decode_floor": jnp.asarray(13.67e-6)})
    assert p.to_registry_units()["attention_decode_floor"] == pytest.approx(13.67)
    assert p.value("attention_decode_floor") == pytest.approx(13.67e-6)
    assert p.value("missing", 7.0) == 7.0
