"""The work around a step (spec methods.md): admission, output token, completion, PD
transfer and offload tiers. Pure functions of the params pytree (seconds), so gradients
reach the host coefficients; :class:`~jkernel.kernel.Kernel` wraps them eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp

from . import laws
from .documents.hardware import StorageClass

__all__ = ["Placement", "UNKNOWN_TIER_S", "to_s", "admission_overhead", "ApiServerWork",
           "api_server_request_time", "api_server_token_time",
           "output_token_overhead", "completion_overhead", "pd_transfer_time", "tier_time"]

#: The "largest representable duration" of the reference, 2⁶³ − 1 ns, in seconds.
UNKNOWN_TIER_S = (2 ** 63 - 1) * 1e-9


@dataclass(frozen=True)
class Placement:
    """Where one end of a transfer sits: ``node`` and ``rack`` indices (whole, ≥ 0) and the
    ``pool`` (a role or index of the deployment's pools, "" unstated; checked against the
    deployment by :meth:`jkernel.Kernel.pd_transfer_time`)."""

    node: int = 0
    rack: int = 0
    pool: str | int = ""

    def __post_init__(self):
        from . import validate as _v

        object.__setattr__(self, "node", _v.whole("node", self.node))
        object.__setattr__(self, "rack", _v.whole("rack", self.rack))
        if not isinstance(self.pool, str):
            object.__setattr__(self, "pool", _v.whole("pool", self.pool))


def to_s(x):
    """``x`` with NaN or negative values as 0; +inf stays (methods.md)."""
    x = jnp.asarray(x)
    return jnp.where(jnp.isnan(x) | (x < 0), 0.0, x)


def _get(params, name: str):
    return params[name] if name in params else jnp.zeros((), jnp.result_type(
        params["peak_flops_per_s"]))


def admission_overhead(params, prompt_tokens):
    """Tokenisation and templating before scheduling, seconds (methods.md §1)."""
    t = jnp.asarray(prompt_tokens)
    cost = _get(params, "host_admission_per_request") + _get(params, "host_admission_per_token") * t
    return jnp.where(t > 0, to_s(cost), 0.0)


def output_token_overhead(params):
    """Host work per emitted token, seconds (methods.md §2)."""
    return to_s(_get(params, "host_output_token"))


def completion_overhead(params):
    """Fixed host cost when a request finishes, seconds (methods.md §3)."""
    return to_s(_get(params, "host_completion"))


class ApiServerWork(NamedTuple):
    """The time one API server process spends on a request's admission and on streaming
    one token, seconds: the work a replay queues on that process
    (:mod:`jkernel.replay.sim`). jkernel's own; the spec prices the front end as delays only.
    """

    per_request_s: float
    per_token_s: float


def api_server_request_time(params):
    """The API server's time on one request's admission (HTTP and JSON, chat template,
    tokenisation), seconds: ``host_api_server_per_request`` (0 when absent)."""
    return to_s(_get(params, "host_api_server_per_request"))


def api_server_token_time(params):
    """The API server's time on one streamed token (detokenisation, the response chunk),
    seconds: ``host_api_server_per_token`` (0 when absent)."""
    return to_s(_get(params, "host_api_server_per_token"))


def pd_transfer_time(params, tokens, *, kv_bytes_per_token: float, same_node: bool,
                     same_rack_domain: bool, floor_name: str | None):
    """One request's whole KV cache from the prefill to the decode pool, seconds (§4).

    ``nbytes = tokens · kvB`` (per rank, not divided by DCP, not paged) at NVLink when both
    ends share a node (or a rack NVLink domain), else at the NIC rate; the floor is the
    (alltoall, Expert) key's ``t0``.
    """
    t = jnp.asarray(tokens)
    nbytes = t * kv_bytes_per_token
    rate = params["nvlink_bytes_per_s"] if (same_node or same_rack_domain) else \
        params["nic_bytes_per_s"]
    floor = params[floor_name] if floor_name else 0.0
    return jnp.where(t > 0, to_s(laws.floor_rate_time(nbytes, floor, rate)), 0.0)


def tier_time(params, device: StorageClass | None, direction: str, nbytes, queue_depth=1):
    """Move ``nbytes`` between HBM and an offload tier, seconds (methods.md §5).

    ``direction``: ``"to_tier"`` (a write) or ``"from_tier"`` (a read). An unknown tier
    (``device`` None) costs :data:`UNKNOWN_TIER_S`.
    """
    if direction not in ("to_tier", "from_tier"):
        raise ValueError(f"direction must be 'to_tier' or 'from_tier', not {direction!r}")
    if device is None:
        return jnp.asarray(UNKNOWN_TIER_S)
    mb = device.read_mb_s if direction == "from_tier" else device.write_mb_s
    rate = jnp.asarray(mb * 1e6)
    link = _get(params, "host_link_bandwidth")
    rate = jnp.where(link > 0, jnp.minimum(rate, link), rate)
    depth = jnp.asarray(queue_depth)
    rate = jnp.where(depth > 1, rate / jnp.where(depth > 1, depth, 1), rate)
    return to_s(laws.floor_rate_time(nbytes, device.base_latency_us * 1e-6, rate))
