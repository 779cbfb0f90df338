"""Collective floor, transition and peak rates per operation and width (NCCL sweeps).

Every ``(op, N)`` of the NCCL table's half-precision rows (``message_size`` counts
elements, 2 bytes each; the loader turns it into ``message_bytes``) is one group with the
three coefficients of step.md §2's law, :func:`jkernel.laws.collective_time`::

    t = max(t0 + b / r_t, b / r_peak)

named ``collective_{floor,transition_rate,peak_rate}_<op>_fp16_<N>rank_<chip>``. All groups
are fitted in one vectorised problem (log-space parameters gathered per row), starting from
the deterministic grid search of :func:`fit_collective` (the catalog's
previous rule), which is also reported as a comparison curve on the same rows. The
``int8`` rows are not fitted: ``collective_*_int8_*`` is never read (documents.md §8.6).

**Unidentified peak.** When no measured message is large enough to be bound by the peak
rate, the data has no curvature along it (:mod:`~jkernel.calibration.fit.uncertainty` flags it). The
value written is then ``max(r_t, best measured throughput)``, which binds nowhere in the
data and so changes no prediction (the seed's rule), with ``identifiable: false``.

**vLLM's custom all-reduce** (``custom_allreduce_perf``) is much faster than NCCL for small
messages (H100, 8 GPUs: 4.7 µs against 15.6 µs at 1 KiB), and vLLM runs it for messages
below its buffer size when ``all_reduce_backend`` resolves to ``custom``. The spec prices
every all-reduce with the one ``all_reduce`` key (the backend is reported only), so by
default (``allreduce="nccl"``) the key is fitted on NCCL as the seed did, and the custom
all-reduce is reported, not written: its own law per width (graph variant) and the error
of the written NCCL law on the custom rows, i.e. how much the single key over-charges a
custom all-reduce. ``allreduce="vllm"`` instead fits the ``all_reduce`` keys on the
composite vLLM would run: custom all-reduce (graph variant) rows below 8 MiB (vLLM's default
``CustomAllreduce`` buffer) and NCCL rows from 8 MiB up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp
import numpy as np

from jkernel import laws
from jkernel.laws import collective_time

from .base import (ErrorRow, ErrorStats, Param, PrimitiveFit, Problem, columns, plot_series,
                  slices_table, solve)

__all__ = ["OPS", "CUSTOM_AR_MAX_BYTES", "collective_names", "fit_collectives", "Fit",
           "fit_collective", "mean_abs_log_error", "geometric_error", "written", "rounded",
           "extrapolate_16", "scale_rates", "PEAK_TOLERANCE", "RING_16_OVER_8"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "alltoall")
#: vLLM's default custom all-reduce buffer (``CustomAllreduce(max_size=8192 * 1024)``).
CUSTOM_AR_MAX_BYTES = 8 * 1024 * 1024



# --------------------------------------------------------------------------------------
# The grid-search fit of one collective law (the seed's rule, the start of the Adam fit)
# --------------------------------------------------------------------------------------

RING_16_OVER_8 = 14.0 / 15.0   # (16/15) / (8/7): bus-bandwidth factor, 8 → 16 ranks
PEAK_TOLERANCE = 1e-3          # mean |log ratio| a binding peak must save to be kept


@dataclass(frozen=True)
class Fit:
    """One fitted law in SI units, with where it came from."""

    floor_s: float
    peak_per_s: float
    transition_per_s: float
    geo_error: float = float("nan")   # exp(mean |log(pred/measured)|) on the fitted rows
    rows: int = 0
    source: str = ""                  # data file (relative to the data root) or derivation


@jax.jit
def _mean_abs_log(b, t, floor_s, peak_per_s, transition_per_s):
    pred = collective_time(b, floor_s[..., None], peak_per_s[..., None],
                           transition_per_s[..., None])
    return jnp.mean(jnp.abs(jnp.log(pred / t)), axis=-1)


def mean_abs_log_error(nbytes, seconds, floor_s, peak_per_s, transition_per_s):
    """Mean over points of ``|log(collective_time / measured)|``. The parameters may be arrays
    of candidates (shape ``(K,)``), and then the result has shape ``(K,)``. Float32, jitted."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return _mean_abs_log(f32(nbytes), f32(seconds), f32(floor_s), f32(peak_per_s),
                         f32(transition_per_s))


def fit_collective(nbytes, seconds, rounds: int = 14) -> Fit:
    """Fit (floor, peak, transition) to measured ``(nbytes, seconds)``. The search is
    deterministic: a 15³ grid over log-parameters, centred on the smallest latency and the
    best measured throughput, then 9³ grids at half the width around the best point each
    round."""
    b = np.asarray(nbytes, float)
    t = np.asarray(seconds, float)
    best_tput = float(np.max(b / t))
    centre = np.log([float(np.min(t)), best_tput, best_tput])
    half = np.log([4.0, 30.0, 30.0])
    size = 15
    for _ in range(rounds):
        axes = [c + h * np.linspace(-1.0, 1.0, size) for c, h in zip(centre, half)]
        grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
        err = np.asarray(mean_abs_log_error(b, t, *np.exp(grid).T))
        centre = grid[int(np.argmin(err))]
        half, size = half / 2.0, 9
    floor_s, peak, trans = (float(x) for x in np.exp(centre))
    fit = Fit(floor_s, peak, trans, rows=len(b))
    # A peak that binds nowhere, or improves the error by less than PEAK_TOLERANCE, is not
    # identified by the data: record max(transition, best throughput), which binds nowhere.
    loose = replace(fit, peak_per_s=max(trans, best_tput))
    if mean_abs_log_error(b, t, *_params(loose)) <= mean_abs_log_error(b, t, *_params(fit)) \
            + PEAK_TOLERANCE:
        fit = loose
    return replace(fit, geo_error=geometric_error(b, t, fit))


def _params(fit: Fit):
    return fit.floor_s, fit.peak_per_s, fit.transition_per_s


def geometric_error(nbytes, seconds, fit: Fit) -> float:
    """``exp(mean |log ratio|)`` of ``fit`` on the points, e.g. 1.14 for a typical 14 % miss."""
    return float(np.exp(mean_abs_log_error(nbytes, seconds, fit.floor_s, fit.peak_per_s,
                                           fit.transition_per_s)))


def written(fit: Fit) -> tuple[float, int, int]:
    """The values as written: floor in µs to 0.01, rates in whole bytes/µs (half up)."""
    up = lambda x: math.floor(x + 0.5)
    return (up(fit.floor_s * 1e8) / 100.0, up(fit.peak_per_s / 1e6),
            up(fit.transition_per_s / 1e6))


def rounded(fit: Fit) -> Fit:
    """``fit`` with its parameters replaced by the written values (back in SI units)."""
    floor_us, peak, trans = written(fit)
    return replace(fit, floor_s=floor_us * 1e-6, peak_per_s=peak * 1e6,
                   transition_per_s=trans * 1e6)


def extrapolate_16(fit4: Fit, fit8: Fit) -> Fit:
    """16-rank law from the 4- and 8-rank fits: floor × (floor8/floor4, at least 1), and
    rates × 14/15."""
    growth = max(fit8.floor_s / fit4.floor_s, 1.0)
    return Fit(fit8.floor_s * growth, fit8.peak_per_s * RING_16_OVER_8,
               fit8.transition_per_s * RING_16_OVER_8,
               source=f"extrapolated from 4- and 8-rank fits ({fit8.source})")


def scale_rates(fit: Fit, factor: float, source: str) -> Fit:
    """The same law with both rates multiplied by ``factor`` (floor kept)."""
    return replace(fit, peak_per_s=fit.peak_per_s * factor,
                   transition_per_s=fit.transition_per_s * factor,
                   geo_error=float("nan"), source=source)



def collective_names(op: str, width: int, chip: str) -> tuple[str, str, str]:
    """``(floor, peak, transition)`` registry names of one key (``chip`` as the catalog
    spells it; ``-`` becomes ``_``)."""
    key = chip.replace("-", "_")
    return tuple(f"collective_{part}_{op}_fp16_{width}rank_{key}"
                 for part in ("floor", "peak_rate", "transition_rate"))


def _predict(groups):
    def predict(v, d):
        idx = d["group"].astype(jnp.int32)
        t0 = jnp.stack([v[g[2]] for g in groups])[idx]
        peak = jnp.stack([v[g[3]] for g in groups])[idx]
        trans = jnp.stack([v[g[4]] for g in groups])[idx]
        return laws.collective_time(d["message_bytes"], t0, peak, trans)
    return predict


def _seed_start(nbytes, seconds):
    f = fit_collective(nbytes, seconds)
    return f.floor_s, f.peak_per_s, f.transition_per_s


def _select_rows(nccl, custom, allreduce: str):
    """(rows by group key, description) of the rows to fit."""
    base = nccl.select((nccl.dtype == "fp16") & np.isin(nccl.op, OPS))
    if allreduce == "nccl" or custom is None:
        return base
    if allreduce != "vllm":
        raise ValueError("allreduce must be 'nccl' or 'vllm'")
    from ..data.profiles import CollectiveObservations
    graph = custom.select((custom.variant == "graph")
                          & (custom.message_bytes < CUSTOM_AR_MAX_BYTES))
    keep = ~((base.op == "all_reduce") & (base.message_bytes < CUSTOM_AR_MAX_BYTES))
    base = base.select(keep)
    graph = CollectiveObservations(chip=base.chip, source=graph.source, sha256=graph.sha256,
                                   skipped=graph.skipped, **{
                                       **graph.columns(), "dtype": np.full(len(graph), "fp16")})
    return CollectiveObservations.concat([base, graph])


def fit_collectives(nccl, *, chip: str, custom=None, allreduce: str = "nccl",
                    heldout: float = 0.2, seed: int = 0, steps: int = 1500, lr: float = 0.05,
                    delta: float = 0.05) -> PrimitiveFit:
    """Fit every ``(op, width)`` of one chip's NCCL table (and report the custom
    all-reduce); see the module docstring. ``chip`` is the catalog name (``h100``)."""
    t0 = time.perf_counter()
    rows = _select_rows(nccl, custom, allreduce)
    if len(rows) == 0:
        raise ValueError(f"{nccl.source}: no half-precision rows of {', '.join(OPS)}")
    keys = sorted(set(zip(rows.op.tolist(), rows.num_gpus.tolist())),
                  key=lambda k: (OPS.index(k[0]), k[1]))
    fit_obs, held_obs = rows.split(heldout, seed)
    groups = []   # (op, width, floor, peak, transition)
    params: list[Param] = []
    seed_values = {}
    for op, n in keys:
        fl, pk, tr = collective_names(op, n, chip)
        m = (fit_obs.op == op) & (fit_obs.num_gpus == n)
        if not m.any():
            m = (rows.op == op) & (rows.num_gpus == n)
            b, t = rows.message_bytes[m], rows.latency_s[m]
        else:
            b, t = fit_obs.message_bytes[m], fit_obs.latency_s[m]
        s0, sp, st = _seed_start(b.astype(float), t)
        seed_values.update({fl: s0, pk: sp, tr: st})
        groups.append((op, n, fl, pk, tr))
        params += [Param(fl, s0, units="us_per_transfer"), Param(pk, sp, units="bytes_per_us"),
                   Param(tr, st, units="bytes_per_us")]

    def group_index(obs):
        lookup = {(op, n): j for j, (op, n, *_) in enumerate(groups)}
        return np.array([lookup[(o, int(n))] for o, n in zip(obs.op, obs.num_gpus)], float)

    prob = Problem(tuple(params), _predict(groups),
                   columns(fit_obs, ("message_bytes", "latency_s"), group=group_index(fit_obs)),
                   columns(held_obs, ("message_bytes", "latency_s"),
                           group=group_index(held_obs)))
    sol = solve(prob, steps=steps, lr=lr, delta=delta)
    written = {}
    notes = []
    lap = sol.laplace
    for op, n, fl, pk, tr in groups:
        written[fl], written[tr] = sol.values[fl], sol.values[tr]
        written[pk] = sol.values[pk]
        if lap is not None and not lap.identifiable[pk]:
            m = (rows.op == op) & (rows.num_gpus == n)
            best = float(np.max(rows.message_bytes[m] / rows.latency_s[m]))
            written[pk] = max(sol.values[tr], best)
            notes.append(f"{op} {n} ranks: the peak rate binds on no measured message; "
                         f"written as max(transition, best throughput) = "
                         f"{written[pk] / 1e6:,.0f} bytes/µs")
    variants = {"fitted": (prob, written), "seed grid fit (previous catalog rule)":
                (prob, seed_values)}
    fg, hg = prob.fit_rows["group"], prob.held_rows["group"]
    slices = {"all": (np.ones_like(fg, bool), np.ones_like(hg, bool))}
    for j, (op, n, *_) in enumerate(groups):
        slices[f"{op} {n} ranks"] = (fg == j, hg == j)
    errors, preds = slices_table(prob, variants, slices, return_predictions=True)
    entry_slice = {}
    for op, n, fl, pk, tr in groups:
        for name in (fl, pk, tr):
            entry_slice[name] = f"{op} {n} ranks"
    if allreduce == "vllm" and custom is not None:
        notes.append("all_reduce keys fitted on vLLM's composite: custom all-reduce (graph) "
                     f"below {CUSTOM_AR_MAX_BYTES // 2**20} MiB, NCCL from there up")
    if custom is not None:
        errors += _custom_report(custom, groups, written, notes, allreduce)
    plots = []
    for j, (op, n, fl, pk, tr) in enumerate(groups):
        if n != max(g[1] for g in groups if g[0] == op):
            continue
        ps = plot_series(f"{op}, {n} ranks", prob, preds, fg == j, hg == j, "message_bytes",
                         "message (bytes)")
        if ps is not None:
            plots.append(ps)
    return PrimitiveFit("collectives", chip, prob.params, sol.values, written, errors,
                        entry_slice, lap, str(rows.source), str(rows.sha256), len(fit_obs),
                        len(held_obs), dict(nccl.skipped), notes, time.perf_counter() - t0,
                        plots)


def _custom_report(custom, groups, written, notes, allreduce):
    """Error rows of the custom all-reduce (graph variant): its own law per width, and the
    written all_reduce law evaluated on it."""
    out = []
    graph = custom.select(custom.variant == "graph")
    for op, n, fl, pk, tr in groups:
        if op != "all_reduce":
            continue
        fam = graph.select(graph.num_gpus == n)
        if len(fam) < 4:
            continue
        b = fam.message_bytes.astype(float)
        s0, sp, st = _seed_start(b, fam.latency_s)
        own = np.asarray(laws.collective_time(b, s0, sp, st))
        key = np.asarray(laws.collective_time(b, written[fl], written[pk], written[tr]))
        small = b < CUSTOM_AR_MAX_BYTES
        out.append(ErrorRow(f"custom all-reduce (graph) {n} ranks, < 8 MiB",
                            "written all_reduce law", ErrorStats.of(key[small],
                                                                    fam.latency_s[small]),
                            ErrorStats(0, float("nan"), float("nan"))))
        out.append(ErrorRow(f"custom all-reduce (graph) {n} ranks, < 8 MiB",
                            "its own law (not written)", ErrorStats.of(own[small],
                                                                       fam.latency_s[small]),
                            ErrorStats(0, float("nan"), float("nan"))))
        ratio = float(np.median(key[small] / fam.latency_s[small])) if small.any() else 1.0
        notes.append(f"custom all-reduce, {n} ranks: own law floor {s0 * 1e6:.2f} µs, "
                     f"transition {st / 1e6:,.0f} bytes/µs, peak {sp / 1e6:,.0f} bytes/µs "
                     f"(not written); the written all_reduce key prices its messages below "
                     f"8 MiB at {ratio:.2f}× their measured time (median)")
    return out
