"""Exact elasticities of a step time with respect to every kernel parameter.

The elasticity of the step time t with respect to a parameter θ is

    e(θ) = d log t / d log θ = (θ / t) · dt/dθ,

the percentage change of t per percent change of θ. jkernel's step function is a pure JAX
function of its :class:`jkernel.Params` pytree, so e is computed exactly by forward-mode
differentiation: write every parameter as θ·exp(u), differentiate log t with respect to the
vector u at u = 0 with ``jax.jacfwd``. A parameter whose value is 0 has elasticity 0.

``finite_difference_elasticities`` computes the same numbers by central differences of the
same function, in log space; ``tests/test_sensitivity.py`` checks the two agree.

Used by ``notebooks/sensitivity.ipynb``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jkernel
from jkernel.batch import bucket_for

__all__ = ["elasticities", "elasticity_grid", "finite_difference_elasticities",
           "stack_batches", "grid_batches", "scaled_params", "FIELDS"]

FIELDS = ("expected_s", "no_overlap_s", "overlap_s")


def _check(field: str) -> None:
    if field not in FIELDS:
        raise ValueError(f"field must be one of {FIELDS}, not {field!r}")


def _float_params(kernel: jkernel.Kernel) -> jkernel.Params:
    return kernel.params.astype(jnp.float64)


def _log_time(step_fn, field: str):
    """``g(u, θ, arrays) = log t(θ·exp(u))`` for a kernel's pure step function."""

    def g(u, theta, arrays):
        p = jax.tree_util.tree_map(lambda v, x: v * jnp.exp(x), theta, u)
        return jnp.log(getattr(step_fn(p, arrays), field))

    return g


@functools.lru_cache(maxsize=32)
def _programs(step_fn, field: str):
    """Jitted (jacobian and log time over many batches, log time over many perturbations)
    for one step function; cached so that repeated calls never recompile."""
    g = _log_time(step_fn, field)
    with_value = lambda u, theta, arrays: (g(u, theta, arrays),) * 2  # noqa: E731
    jac = jax.jit(jax.vmap(jax.jacfwd(with_value, has_aux=True), in_axes=(None, None, 0)))
    perturbed = jax.jit(jax.vmap(g, in_axes=(0, None, None)))
    return jac, perturbed


def stack_batches(kernel: jkernel.Kernel, batches: Sequence[jkernel.Batch]):
    """Batches padded to one bucket and stacked: a BatchArrays with a leading axis."""
    size = bucket_for(max(len(b) for b in batches), kernel.buckets)
    arrays = [kernel.batch_arrays(b, bucket=size) for b in batches]
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *arrays)


def elasticity_grid(kernel: jkernel.Kernel, batches: Sequence[jkernel.Batch],
                    field: str = "expected_s") -> tuple[list[str], np.ndarray, np.ndarray]:
    """Elasticities for many batches at once.

    Returns ``(names, E, t)``: the parameter names, ``E`` of shape ``(batches, params)`` with
    ``E[b, i] = d log t_b / d log θ_i``, and the step times ``t`` of shape ``(batches,)``
    in seconds.
    """
    _check(field)
    jac_fn, _ = _programs(kernel.step_fn, field)
    theta = _float_params(kernel)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, theta)
    arrays = stack_batches(kernel, batches)
    jac, logt = jac_fn(zeros, theta, arrays)
    names = list(theta)
    E = np.stack([np.asarray(jac[n]) for n in names], axis=-1)
    return names, E, np.exp(np.asarray(logt))


def elasticities(kernel: jkernel.Kernel, batch: jkernel.Batch,
                 field: str = "expected_s") -> dict[str, float]:
    """``{parameter name: d log t / d log θ}`` for one batch (exact, by ``jax.jacfwd``)."""
    names, E, _ = elasticity_grid(kernel, [batch], field)
    return dict(zip(names, (float(x) for x in E[0])))


def finite_difference_elasticities(kernel: jkernel.Kernel, batch: jkernel.Batch,
                                   field: str = "expected_s", h: float = 1e-5,
                                   names: Sequence[str] | None = None) -> dict[str, float]:
    """Central differences of the same step function in log space:
    ``(log t(θ_i·e^h) − log t(θ_i·e^−h)) / 2h``, all perturbations priced in one vmapped
    call. Float64 throughout."""
    _check(field)
    _, perturbed = _programs(kernel.step_fn, field)
    theta = _float_params(kernel)
    names = list(theta) if names is None else list(names)
    all_names = list(theta)
    rows = []
    for n in names:
        for sign in (1.0, -1.0):
            rows.append([sign * h if m == n else 0.0 for m in all_names])
    U = np.asarray(rows, np.float64)                       # (2·len(names), params)
    u = jkernel.Params({m: jnp.asarray(U[:, j]) for j, m in enumerate(all_names)})
    arrays = kernel.batch_arrays(batch)
    logt = np.asarray(perturbed(u, theta, arrays))
    diff = (logt[0::2] - logt[1::2]) / (2 * h)
    return dict(zip(names, (float(x) for x in diff)))


def grid_batches() -> dict[str, jkernel.Batch]:
    """The batch shapes the notebook studies: decode sizes × contexts, prefill chunks,
    and mixed batches (one prefill chunk riding with decodes). All fit bucket 256."""
    out: dict[str, jkernel.Batch] = {}
    for n in (1, 8, 32, 128, 256):
        for ctx in (512, 2048, 8192, 32768):
            out[f"decode {n}x1@{ctx}"] = jkernel.Batch.from_spec(f"{n}x1@{ctx}")
    for chunk in (256, 1024, 4096, 8192):
        out[f"prefill 1x{chunk}@0"] = jkernel.Batch.from_spec(f"1x{chunk}@0")
    out["prefill 1x2048@16384"] = jkernel.Batch.from_spec("1x2048@16384")
    for spec in ("31x1@4096,1x512@0", "63x1@4096,1x2048@0", "127x1@2048,1x4096@0",
                 "255x1@8192,1x1024@8192"):
        out[f"mixed {spec}"] = jkernel.Batch.from_spec(spec)
    return out


def scaled_params(kernel: jkernel.Kernel, factors: Mapping[str, float]) -> jkernel.Params:
    """The kernel's params with every name starting with a key multiplied by its factor
    (``{"host_": 2.0}`` doubles every host coefficient; an exact name matches itself)."""
    params = _float_params(kernel)
    scale = {}
    for prefix, f in factors.items():
        hit = [n for n in params if n == prefix or (prefix.endswith("_") and n.startswith(prefix))]
        if not hit:
            raise KeyError(f"no parameter matches {prefix!r}")
        for n in hit:
            scale[n] = scale.get(n, 1.0) * f
    return params.scaled(**scale)
