"""The pytree of calibratable constants: every coefficient and chip figure a kernel prices with.

:class:`Params` maps names to scalar arrays in **SI units** (seconds, bytes per second,
tokens per second, FLOP/s; dimensionless values as they are). Coefficients keep their
registry names (``gemm_eps_max_fp8``, ``collective_floor_all_reduce_fp16_8rank_h200``…);
chip and link figures use the names in :data:`CHIP_NAMES`. It is the only thing optax
touches, and changing a value never recompiles the step function.

``si_scale(name)`` is the one place registry units (µs, bytes/µs, tokens/µs) are converted.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Params", "si_scale", "CHIP_NAMES"]

#: Chip and link constants held beside the coefficients.
CHIP_NAMES = {
    "peak_flops_per_s": "compute peak for the served dtype (resolution.md §6.2), FLOP/s",
    "hbm_bytes_per_s": "nominal HBM bandwidth BwPeakTBs·1e12, B/s (derated by hbm_derate)",
    "nvlink_bytes_per_s": "IntraNodeBwGBps·1e9, B/s",
    "nic_bytes_per_s": "fabric InterNodeBwGBps·1e9 (NVLink rate without a fabric), B/s",
    "sm_count": "enabled SMs",
}

_MICRO = 1e-6
_PER_MICRO = 1e6


def si_scale(name: str) -> float:
    """Factor from a registry value's unit to SI for coefficient ``name``.

    µs → s for floors and host times; bytes/µs and tokens/µs → per second for rates (the
    recurrent rates' ``units: tokens`` field is a known quirk: the name fixes the meaning).
    Bytes, counts and dimensionless values are unchanged.
    """
    if name in CHIP_NAMES:
        return 1.0
    if ("_rate" in name and (name.startswith("attention_") or name.startswith("recurrent_")
                             or name.startswith("collective_"))) \
            or name == "host_link_bandwidth":
        return _PER_MICRO
    if name.startswith("collective_floor") or name.startswith("host_") \
            or (name.startswith("attention_") and "floor" in name) \
            or (name.startswith("recurrent_") and "floor" in name) \
            or name.startswith("moe_kernel_floor") or name == "moe_assignment_time" \
            or name in ("kernel_gap", "host_serial"):
        return _MICRO
    return 1.0


@jax.tree_util.register_pytree_node_class
class Params(Mapping):
    """Immutable mapping ``name → scalar array`` (SI units), registered as a JAX pytree.

    Leaves are ordered by name, so two Params with the same names flatten alike (``vmap``
    over a stacked Params prices many parameter sets at once).
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, object]):
        self._values = dict(sorted(values.items()))

    # Mapping
    def __getitem__(self, name: str):
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={_fmt(v)}" for k, v in self._values.items())
        return f"Params({body})"

    # pytree
    def tree_flatten(self):
        return tuple(self._values.values()), tuple(self._values.keys())

    @classmethod
    def tree_unflatten(cls, names, leaves):
        obj = object.__new__(cls)
        obj._values = dict(zip(names, leaves))
        return obj

    # helpers
    def replace(self, **values) -> "Params":
        """A copy with some values replaced (names must exist)."""
        unknown = [k for k in values if k not in self._values]
        if unknown:
            raise KeyError(f"unknown parameter(s) {unknown}; known: {list(self._values)}")
        return Params({**self._values, **{k: jnp.asarray(v, dtype=jnp.result_type(self._values[k]))
                                          for k, v in values.items()}})

    def scaled(self, **factors) -> "Params":
        """A copy with some values multiplied by factors."""
        return self.replace(**{k: self._values[k] * f for k, f in factors.items()})

    def astype(self, dtype) -> "Params":
        return Params({k: jnp.asarray(v, dtype=dtype) for k, v in self._values.items()})

    def to_registry_units(self) -> dict[str, float]:
        """Plain floats in the registry's units (µs, bytes/µs…), for writing coefficient sets."""
        return {k: float(np.asarray(v)) / si_scale(k) for k, v in self._values.items()}

    def value(self, name: str, default: float = 0.0) -> float:
        """Eager float of one parameter (for the non-traced methods)."""
        if name not in self._values:
            return default
        return float(np.asarray(self._values[name]))


def _fmt(v) -> str:
    try:
        return f"{float(np.asarray(v)):.6g}"
    except (TypeError, ValueError):
        return f"<{getattr(v, 'shape', '?')}>"
