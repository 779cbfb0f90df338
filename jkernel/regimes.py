"""The regime of an engine step: what kind of work bounds it.

The model's structural error differs by the kind of step it prices (the error model of
``docs/intervals.md`` is stated per regime), so a step is classified the same way wherever
an error is measured (a step trace's residuals) or applied (a replay's steps):

========  ==========================================================================
``host``  the host's work is the step's bottleneck (``StepEstimate.bottleneck`` is the
          ``host`` resource: CPU launch and scheduling outlast the GPU's work)
``decode``  every request runs at most ``decode_threshold`` tokens (a uniform decode)
``prefill``  every request runs more than ``decode_threshold`` tokens (prompt chunks only)
``mixed``  both: decodes and at least one prompt chunk (chunked prefill)
========  ==========================================================================

``host`` is decided first; the others by the batch alone. An empty batch is ``decode``.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

from .step import RESOURCES

__all__ = ["Regime", "REGIMES", "HOST_RESOURCE", "classify", "classify_one", "classify_row"]


class Regime(enum.IntEnum):
    """A step's regime; the integer is its index in per-regime arrays."""

    DECODE = 0
    PREFILL = 1
    MIXED = 2
    HOST = 3

    @property
    def label(self) -> str:
        return self.name.lower()


#: The regimes in index order.
REGIMES = tuple(Regime)
#: ``StepEstimate.bottleneck`` of a host-bound step.
HOST_RESOURCE = RESOURCES.index("host")


def classify(scheduled: np.ndarray, decode_threshold, bottleneck=None) -> np.ndarray:
    """The regime index of each batch (int8, shape ``(B,)``).

    ``scheduled``: tokens run per request, ``(B, R)`` zero-padded; ``decode_threshold``: a
    scalar or ``(B,)``; ``bottleneck``: the steps' ``StepEstimate.bottleneck`` ``(B,)``, or
    None when the resource is not known (then no step is ``host``).
    """
    s = np.asarray(scheduled)
    if s.ndim != 2:
        raise ValueError(f"scheduled must be (batches, requests), got shape {s.shape}")
    thr = np.broadcast_to(np.asarray(decode_threshold), (s.shape[0],))[:, None]
    prefill = (s > thr).any(axis=1)
    decode = ((s > 0) & (s <= thr)).any(axis=1)
    out = np.where(prefill & decode, Regime.MIXED,
                   np.where(prefill, Regime.PREFILL, Regime.DECODE)).astype(np.int8)
    if bottleneck is not None:
        out[np.asarray(bottleneck) == HOST_RESOURCE] = Regime.HOST
    return out


def classify_row(scheduled, decode_threshold, bottleneck):
    """:func:`classify` of one batch inside traced code (``jax.numpy``; ``vmap`` it over
    rows): ``scheduled`` ``(R,)`` zero-padded tokens, ``decode_threshold`` and
    ``bottleneck`` scalars. The regime index as an int32 scalar; a test holds it equal to
    :func:`classify`.

    One reduction over the requests (a bit per kind of request, OR-ed): a program with a
    second one crossed the size at which XLA's CPU runtime stops running it inline
    (``benchmarks/RESULTS.md``) at 64-request rows and cost ~4 × as much."""
    s = jnp.asarray(scheduled)
    code = jnp.where(s > decode_threshold, 1, jnp.where(s > 0, 2, 0)).astype(jnp.int32)
    kinds = jax.lax.reduce(code, np.int32(0), jax.lax.bitwise_or, (code.ndim - 1,))
    out = jnp.where(kinds == 3, int(Regime.MIXED),
                    jnp.where(kinds == 1, int(Regime.PREFILL), int(Regime.DECODE)))
    return jnp.where(bottleneck == HOST_RESOURCE, int(Regime.HOST), out).astype(jnp.int32)


def classify_one(scheduled, decode_threshold: int = 1, bottleneck: int | None = None
                 ) -> Regime:
    """The regime of one batch (``scheduled``: tokens per request)."""
    s = np.asarray(scheduled).reshape(1, -1)
    b = None if bottleneck is None else np.array([bottleneck])
    return Regime(int(classify(s, decode_threshold, b)[0]))
