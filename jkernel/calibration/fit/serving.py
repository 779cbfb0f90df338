"""Fitting engine-level constants to serving measurements: the front end, host work per
step and per request, the compute derate.

A serving run (:mod:`jkernel.calibration.data.serving`) measures latencies, not steps: mean
TTFT and end-to-end latency per group of requests (a load stage), per request where the
client kept them. Through the replay (:func:`jkernel.replay.replay`) they are a function of
the kernel's constants, smooth where the batches stay the same and not where a changed step
cost reshapes the queue. The fit uses each where it holds:

**The fixed point, by gradient.** A replay run with ``record=True`` keeps every step's batch
and the steps that deliver each request's first and last token
(:class:`jkernel.replay.sim.StepRecord`). With those batches held fixed, a token reaches the
client at ``arrival(waker) + admission(waker) + Σ step durations of the busy period up to
its step + output_token_overhead`` (the waker's arrival opened the busy period), so every
group's mean TTFT and E2E is an exact, differentiable function of the constants: the step
function's ``expected_s`` over the logged batches (:func:`~jkernel.calibration.fit.traces.
log_price`) and the front end's ``admission_overhead`` / ``output_token_overhead`` /
``completion_overhead`` (:mod:`jkernel.overheads`). At the constants it was replayed with,
this function reproduces the replay to the microsecond. The fit minimises, over ``θ = log``
of the fitted constants,

    L(θ) = Σ_groups Σ_{m ∈ fit_on} ρ(r_gm / σ) + ½ Σ_j ((θ_j − μ_j) / σ_p)²,
    r_g,ttft = log(TTFT_pred / TTFT_meas),   r_g,itl = log(ITL_pred / ITL_meas),

(ρ the soft-L1 loss of :mod:`~jkernel.calibration.fit.base` at ``δ = 1``, i.e. quadratic
within ±σ and linear beyond; σ = :data:`SIGMA`; log-normal priors of width ``σ_p`` around
the starting values, :data:`PRIORS`) by damped Gauss–Newton with the soft-L1 weights
(IRLS); the Jacobian is ``jax.jacfwd`` of the fixed-point function.

**The rest, derivative-free.** A new step cost changes the batches, and near a deployment's
knee the queue: that part of the dependence has no useful gradient (the schedule is a
discrete function of the step times). The outer loop replays at the proposed constants and
accepts them only if the *replayed* loss falls, halving the step up to twice otherwise (a
backtracking line search on the replay, which never differentiates the schedule); the
accepted replay is the next fixed point. It stops when a step moves no constant by more than
:data:`TOLERANCE` in log, after :data:`MAX_OUTER` replays of the fit runs, or when no step is
accepted. A run past its knee (a queue the replay builds and the engine did not, or the
reverse) weighs through ρ's linear tail, not quadratically.

**Uncertainty** is the Laplace (Gauss–Newton) approximation of
:func:`~jkernel.calibration.fit.uncertainty.gauss_newton` at the last fixed point, with the
priors' precision; identifiability is judged from the data alone, before the fit, at the
first fixed point: a constant the groups cannot tell apart from the others is not fitted and
keeps its starting value (and says so).

**Speed: sampled groups.** Replaying every request of long runs at every iteration is the
cost; with ``sample`` set, each group is replayed on its own: its first ``transient``
requests (at least :data:`TRANSIENT_MIN`, and two mean E2E's worth at its rate), then
``sample`` more. In a run's first group the transient is counted as it happened (the engine
started cold there too) and the sample stands for the rest of the group; a later group
started warm, so its transient only warms the replay and the sample alone is its mean. The
stage means are then estimates from a sample of the same regenerated arrivals (the measured
runs' arrivals were not published for the trainval source); ``sample=0`` replays whole runs.

Constants are fitted per deployment class: runs of one chip and one engine version share
them (:func:`class_of`); a class's front end is fitted only from runs measured on the
client's clock (``clock: client``); runs on the engine's clock replay with no front end.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from ..data.serving import ServingRun
from .base import soft_l1
from .traces import log_price, zero_scale
from .uncertainty import Laplace, gauss_newton

__all__ = ["SERVING_CONSTANTS", "FRONT_END", "STEP", "PRIORS", "SIGMA", "TOLERANCE",
           "MAX_OUTER", "TRANSIENT_MIN", "SAMPLE", "DeploymentClass", "class_of",
           "Segment", "FixedPoint", "fixed_point", "segments_of", "ServingFit", "fit_serving",
           "evaluate", "group_table"]

#: The engine-level constants a serving fit moves, with their meaning.
SERVING_CONSTANTS = {
    "host_serial": "host time per step the GPU does not hide (scheduler, input preparation, "
                   "update from the sampled tokens), s",
    "host_serial_per_request": "the same per scheduled request (the engine's per-request "
                               "Python work and sampling), s",
    "compute_derate": "compute rate sustained in the engine relative to the profiles' "
                      "isolated kernels, in (0, 1]",
    "host_admission_per_request": "the API server's front end before a request's first "
                                  "step, fixed per request (HTTP and JSON, the tokeniser call "
                                  "and its batching window, input processing, hand-off to the "
                                  "engine core), s",
    "host_admission_per_token": "the same per prompt token (tokenisation, prefix-cache block "
                                "hashing, serialisation of the token ids), s",
}
#: The front end: what a run on the engine's clock (``clock: engine``) does not measure.
FRONT_END = ("host_admission_per_request", "host_admission_per_token", "host_output_token",
             "host_completion")
#: The step constants (what every run measures).
STEP = ("host_serial", "host_serial_per_request", "compute_derate")
#: Log-normal priors: name → (centre, σ_p in log), SI units; None centre: the starting
#: value (the catalog's for the deployment). ``host_admission_per_token`` is centred on the
#: tokeniser's throughput on one core of a DGX H100, about 1k tokens per ms
#: (vllm-project/vllm issue 19012, docs/calibrate.md), the rest of its per-token work
#: unknown: a factor 3 either way.
PRIORS = {"host_serial": (None, math.log(3.0)), "host_serial_per_request": (None, math.log(3.0)),
          "compute_derate": (None, math.log(1.5)),
          "host_admission_per_request": (2e-3, math.log(3.0)),
          "host_admission_per_token": (1e-6, math.log(3.0))}
#: Upper bounds (SI) of fitted constants.
UPPER = {"compute_derate": 1.0}
#: The residual scale of the loss (log ratio): group means are trusted to about 3 %.
SIGMA = 0.03
#: Outer-loop stop: the largest move of a fitted constant, in log.
TOLERANCE = 0.01
#: At most this many replays of the fit runs after the first.
MAX_OUTER = 4
#: A group's transient (see the module docstring): at least this many requests.
TRANSIENT_MIN = 100
#: Default sampled requests per group after the transient (0: whole runs).
SAMPLE = 300


# --------------------------------------------------------------------------------------
# Deployment classes

class DeploymentClass(NamedTuple):
    """Runs whose engine constants are shared: one chip, one engine version."""

    hardware: str
    engine_version: str

    def __str__(self) -> str:
        return f"{self.hardware}, vLLM {self.engine_version}"


def class_of(kernel) -> DeploymentClass:
    sc = kernel.inputs.scenario
    return DeploymentClass(str(sc.cluster.hardware), str(sc.engine_version))


def describe(kernel) -> dict:
    """A kernel's deployment: chip, engine version, model, tp (the report's columns)."""
    sc = kernel.inputs.scenario
    return {"chip": str(sc.cluster.hardware), "engine_version": str(sc.engine_version),
            "model": str(sc.model), "tp": int(kernel.resolved().tensor_parallel())}


# --------------------------------------------------------------------------------------
# Segments: what one replay covers, and which of its requests count

@dataclass
class Segment:
    """One replay of a fit: the requests of a run (or of one group of it), and for each
    request its group position (−1: not counted) and weight in its group's mean."""

    run: ServingRun
    requests: pd.DataFrame
    group_pos: np.ndarray          # per request: index into run.groups, −1 not counted
    weight: np.ndarray             # per request: weight in its group's mean


def _pow2(n: int, at_least: int = 64) -> int:
    return max(at_least, 1 << max(0, int(n - 1).bit_length()))


def segments_of(run: ServingRun, *, sample: int = SAMPLE,
                transient_min: int = TRANSIENT_MIN) -> list[Segment]:
    """The replays that stand for ``run``: the whole run (``sample`` 0, or a run whose
    groups are short), else one per group (module docstring, "Speed")."""
    df = run.requests
    keys = run.group_keys()
    pos_of = {g.key: i for i, g in enumerate(run.groups)}
    measured_ok = np.ones(len(df), bool)
    if run.measured_ttft_s is not None:
        measured_ok = np.isfinite(run.measured_ttft_s) & np.isfinite(run.measured_e2e_s)
    whole_pos = np.array([pos_of.get(int(k), -1) for k in keys], np.int64)
    whole_pos[~measured_ok] = -1
    plans = []
    arrival = df["arrival_s"].to_numpy(float)
    for i, g in enumerate(run.groups):
        idx = np.flatnonzero(keys == g.key)
        n = len(idx)
        span = float(arrival[idx[-1]] - arrival[idx[0]]) if n > 1 else 0.0
        rate = (n - 1) / span if span > 0 else 0.0
        m = min(n, max(transient_min, int(math.ceil(2.0 * rate * g.e2e_mean_s))))
        s = min(n - m, sample)
        plans.append((i, idx, m, s))
    if sample <= 0 or all(m + s >= len(idx) for _, idx, m, s in plans):
        return [Segment(run, df, whole_pos, (whole_pos >= 0).astype(float))]
    out = []
    for i, idx, m, s in plans:
        n = len(idx)
        take = idx[:m + s]
        sub = df.iloc[take].reset_index(drop=True)
        sub["arrival_s"] = sub["arrival_s"] - float(sub["arrival_s"].iloc[0])
        pos = np.full(len(take), i, np.int64)
        w = np.zeros(len(take))
        first = i == 0
        if first:
            w[:m] = 1.0
            w[m:] = (n - m) / s if s else 0.0
        else:
            w[m:] = 1.0
            if s == 0:               # a group shorter than its warm-up: count it all
                w[:] = 1.0
        ok = measured_ok[take]
        pos[(w == 0) | ~ok] = -1
        w[pos < 0] = 0.0
        out.append(Segment(run, sub, pos, w))
    return out


# --------------------------------------------------------------------------------------
# The fixed point of one replay

class _Arrays(NamedTuple):
    """The jit arguments of one segment's fixed-point function (padded to powers of two)."""

    batches: object            # BatchArrays stacked (N, R)
    engine_mask: jax.Array     # (E, N) float: step belongs to engine e
    opener: jax.Array          # (N,) int: the step that opened the step's busy period
    waker: jax.Array           # (N,) int: the request whose arrival opened it
    arrival: jax.Array         # (Q,) float s
    prompt: jax.Array          # (Q,) int
    first: jax.Array           # (K,) int: step of each counted request's first token
    last: jax.Array            # (K,) int
    counted: jax.Array         # (K,) int: the request
    weight: jax.Array          # (K,) float
    group: jax.Array           # (K,) int: position in the run's groups


@dataclass
class FixedPoint:
    """One replay held fixed: the segment, its kernel and names, the padded arrays, and
    the replay's own result (``result``) for the report."""

    segment: Segment
    kernel: object
    names: tuple[str, ...]
    arrays: _Arrays
    groups: int
    result: object
    steps: int


def _batches(scheduled, computed, pad, threshold: int, buckets) -> tuple[object, int]:
    from jkernel.batch import bucket_for
    from jkernel.step import BatchArrays

    n = len(scheduled)
    R = bucket_for(max((len(s) for s in scheduled), default=1), buckets)
    N = _pow2(n, 256)
    S = np.zeros((N, R), np.int32)
    C = np.zeros((N, R), np.int32)
    M = np.zeros((N, R), bool)
    for j, (s, c) in enumerate(zip(scheduled, computed)):
        k = len(s)
        S[j, :k] = s
        C[j, :k] = c
        M[j, :k] = True
    S[n:, 0], M[n:, 0] = 1, True           # padding steps: a 1-token decode, never read
    P = np.zeros(N, np.int32)
    P[:n] = pad
    return BatchArrays(S, C, M, np.full(N, threshold, np.int32), np.zeros(N, np.int32), P), N


def fixed_point(segment: Segment, kernel, names: Sequence[str], result) -> FixedPoint:
    """The fixed-point arrays of ``segment`` replayed by ``kernel`` (``result``, a
    :class:`~jkernel.replay.ReplayResult` with its record)."""
    rec = result.record
    n = len(rec.scheduled)
    threshold = int(kernel.settings.get("decode_threshold", 1))
    batches, N = _batches(rec.scheduled, rec.computed, rec.pad, threshold, kernel.buckets)
    eng = np.asarray(rec.engine, np.int64)
    engines = int(eng.max()) + 1 if n else 1
    mask = np.zeros((engines, N))
    for e in range(engines):
        mask[e, :n] = eng == e
    opener = np.zeros(N, np.int64)
    waker = np.zeros(N, np.int64)
    last_open: dict[int, int] = {}
    wk = np.asarray(rec.waker, np.int64)
    for s in range(n):
        e = int(eng[s])
        if wk[s] >= 0:
            last_open[e] = s
        o = last_open.get(e, s)
        opener[s] = o
        waker[s] = wk[o] if wk[o] >= 0 else 0
    req = result.requests
    Q = _pow2(len(req))
    arrival = np.zeros(Q)
    arrival[:len(req)] = req["arrival_s"].to_numpy(float)
    prompt = np.zeros(Q, np.int64)
    prompt[:len(req)] = req["input_tokens"].to_numpy(np.int64)
    pos = segment.group_pos
    done = (rec.first_step >= 0) & (rec.last_step >= 0)
    cnt = np.flatnonzero((pos >= 0) & done)
    K = _pow2(len(cnt))
    first = np.zeros(K, np.int64)
    last = np.zeros(K, np.int64)
    counted = np.zeros(K, np.int64)
    weight = np.zeros(K)
    group = np.zeros(K, np.int64)
    first[:len(cnt)] = rec.first_step[cnt]
    last[:len(cnt)] = rec.last_step[cnt]
    counted[:len(cnt)] = cnt
    weight[:len(cnt)] = segment.weight[cnt]
    group[:len(cnt)] = pos[cnt]
    arrays = _Arrays(batches, jnp.asarray(mask), jnp.asarray(opener), jnp.asarray(waker),
                     jnp.asarray(arrival), jnp.asarray(prompt), jnp.asarray(first),
                     jnp.asarray(last), jnp.asarray(counted), jnp.asarray(weight),
                     jnp.asarray(group))
    return FixedPoint(segment, kernel, tuple(names), arrays, len(segment.run.groups), result, n)


@functools.lru_cache(maxsize=64)
def _program(step_fn, names: tuple[str, ...], groups: int):
    """``(θ, base, arrays) → (Σw·ttft, Σw·e2e, Σw)`` per group, and its Jacobian in θ,
    jitted (cached per step function, names and group count)."""
    from ... import overheads

    price = log_price(step_fn, "expected_s", names)

    def sums(theta, base, a: _Arrays):
        p = base.replace(**{n: jnp.exp(theta[i]) for i, n in enumerate(names)}) if names \
            else base
        d = jnp.exp(price(theta, base, [a.batches]))
        cum = jnp.sum(jnp.cumsum(d[None, :] * a.engine_mask, axis=1) * a.engine_mask, axis=0)
        adm = overheads.admission_overhead(p, a.prompt)
        anchor = a.arrival[a.waker] + adm[a.waker]
        end = anchor + cum - cum[a.opener] + d[a.opener]
        ot = overheads.output_token_overhead(p)
        co = overheads.completion_overhead(p)
        arr = a.arrival[a.counted]
        ttft = end[a.first] + ot - arr
        e2e = end[a.last] + ot + co - arr
        seg = lambda x: jax.ops.segment_sum(x, a.group, num_segments=groups)  # noqa: E731
        return jnp.stack([seg(a.weight * ttft), seg(a.weight * e2e), seg(a.weight)])

    value = jax.jit(sums)
    both = jax.jit(lambda th, base, a: (sums(th, base, a), jax.jacfwd(sums)(th, base, a)))
    return value, both


def _theta_of(fp: FixedPoint, names: Sequence[str], theta: np.ndarray) -> np.ndarray:
    idx = [list(names).index(n) for n in fp.names]
    return np.asarray(theta)[idx] if idx else np.zeros(0)


def _sums(fp: FixedPoint, names, theta, jac: bool):
    value, both = _program(fp.kernel.step_fn, fp.names, fp.groups)
    th = jnp.asarray(_theta_of(fp, names, theta))
    if not jac:
        return np.asarray(value(th, fp.kernel.params, fp.arrays)), None
    v, J = both(th, fp.kernel.params, fp.arrays)
    Jfull = np.zeros((3, fp.groups, len(names)))
    for i, n in enumerate(fp.names):
        Jfull[:, :, list(names).index(n)] = np.asarray(J)[:, :, i]
    return np.asarray(v), Jfull


# --------------------------------------------------------------------------------------
# Residuals

class _Row(NamedTuple):
    run: int
    group: int
    metric: str        # "ttft" or "itl"


def _predicted(fps: Sequence[FixedPoint], runs: Sequence[ServingRun], names, theta,
               jac: bool = False):
    """Per run and group: predicted mean TTFT, mean E2E (s) and, with ``jac``, their
    gradients in θ; from the fixed points (summed over a run's segments)."""
    acc = {}
    where = {id(run): i for i, run in enumerate(runs)}
    for fp in fps:
        r = where[id(fp.segment.run)]
        v, J = _sums(fp, names, theta, jac)
        a = acc.setdefault(r, [np.zeros((3, fp.groups)), np.zeros((3, fp.groups, len(names)))])
        a[0] += v
        if jac:
            a[1] += J
    out = {}
    for r, (v, J) in acc.items():
        for g in range(v.shape[1]):
            w = v[2, g]
            if w <= 0:
                continue
            t, e = v[0, g] / w, v[1, g] / w
            dt = J[0, g] / w - v[0, g] * J[2, g] / w ** 2
            de = J[1, g] / w - v[1, g] * J[2, g] / w ** 2
            out[(r, g)] = (t, e, dt, de)
    return out


def _residuals(runs, pred, rows_only: bool = False):
    """Log-ratio residuals and their gradients over the groups' fitted metrics."""
    rows, r, J = [], [], []
    for (ri, g), (t, e, dt, de) in sorted(pred.items()):
        run = runs[ri]
        m = run.groups[g]
        out1 = max(m.output_mean - 1.0, 1.0)
        for metric in run.fit_on:
            if metric == "ttft":
                val, meas, grad = t, m.ttft_mean_s, dt
            else:
                val, meas, grad = (e - t) / out1, m.itl_mean_s, (de - dt) / out1
            if not (val > 0 and meas > 0):
                continue
            rows.append(_Row(ri, g, metric))
            r.append(math.log(val / meas))
            J.append(np.asarray(grad) / val)
    return rows, np.asarray(r), (np.asarray(J) if J else np.zeros((0, 0)))


def _loss(r: np.ndarray, theta, mu, sp) -> float:
    data = float(np.sum(soft_l1(np.asarray(r) / SIGMA, 1.0)))
    return data + 0.5 * float(np.sum(((np.asarray(theta) - mu) / sp) ** 2))


# --------------------------------------------------------------------------------------
# Replays

def _kernel_at(base_kernel, names, theta, clock: str):
    """The kernel with ``names`` at ``exp θ`` (and, on the engine's clock, no front end);
    ``theta`` None: the kernel as shipped."""
    if theta is None:
        return base_kernel
    vals = {n: float(np.exp(t)) for n, t in zip(names, theta)}
    if clock == "engine":
        vals.update({n: 0.0 for n in FRONT_END if n in base_kernel.params})
    return base_kernel.with_params(base_kernel.params.replace(**vals))


def _replay_segments(segments: Sequence[Segment], kernels: dict, names, theta,
                     log: Callable[[str], None] | None = None) -> list[FixedPoint]:
    from jkernel.replay import replay

    out = []
    for seg in segments:
        base = kernels[id(seg.run)]
        k = _kernel_at(base, names, theta, seg.run.clock)
        clients = seg.run.clients if len(seg.requests) == len(seg.run.requests) else None
        res = replay(k, seg.requests, record=True, clients=clients)
        seg_names = () if theta is None else tuple(
            n for n in names if not (seg.run.clock == "engine" and n in FRONT_END))
        out.append(fixed_point(seg, k, seg_names, res))
    if log:
        log(f"replayed {len(segments)} segments, {sum(f.steps for f in out)} steps")
    return out


# --------------------------------------------------------------------------------------
# The fit

@dataclass
class ServingFit:
    """Result of :func:`fit_serving` for one deployment class.

    Attributes:
      cls: the :class:`DeploymentClass`.
      names: the constants fitted (identifiable ones); ``frozen``: those left at their
        starting values, with the reason.
      start, values: SI values before and after (every candidate name).
      laplace: the Gauss–Newton approximation at the last fixed point.
      runs: the fit runs; ``held``: the held-out runs of the class.
      table: per run and group, measured, before and after (:func:`group_table`).
      history: per outer iteration, the replayed loss and the step fraction accepted.
      replays: replays of the fit runs; ``wall_s``: seconds.
    """

    cls: DeploymentClass
    names: tuple[str, ...]
    frozen: dict
    start: dict
    values: dict
    laplace: Laplace | None
    runs: list
    held: list
    table: pd.DataFrame
    history: list = field(default_factory=list)
    replays: int = 0
    wall_s: float = 0.0
    deployments: list = field(default_factory=list)

    def ci95(self, name: str):
        if self.laplace is None or name not in self.laplace.names:
            return None
        return self.laplace.ci95[name]


def _start(kernel, name: str) -> float:
    v = float(kernel.params[name]) if name in kernel.params else 0.0
    return v if v > 0 else zero_scale(name) if name in STEP else PRIORS.get(name, (1e-6,))[0]


def _identifiable(J: np.ndarray, names, sp) -> dict[str, str]:
    """Data-only identifiability of each column of the (weighted) Jacobian (the rule of
    :func:`~jkernel.calibration.fit.uncertainty.gauss_newton`): name → reason ("" if
    identifiable)."""
    if J.size == 0:
        return {n: "no fitted group measures it" for n in names}
    from .uncertainty import gauss_newton as _gn

    lap = _gn(lambda th: jnp.asarray(J) @ th, np.zeros(len(names)), names,
              to_value=lambda th: th, sigma=SIGMA, jacobian=J)
    del sp
    return {n: ("" if lap.identifiable[n] else (lap.reason[n] or "not identified"))
            for n in names}


def fit_serving(runs: Sequence[ServingRun], names: Sequence[str] | None = None, *,
                held: Sequence[ServingRun] = (), sample: int = SAMPLE,
                max_outer: int = MAX_OUTER, log: Callable[[str], None] | None = None,
                kernels: dict | None = None) -> ServingFit:
    """Fit ``names`` (default: :data:`SERVING_CONSTANTS`) to the ``runs`` of one
    deployment class (module docstring), and evaluate before and after on ``runs`` and
    ``held``. ``kernels``: run name → its kernel, when already open."""
    import jkernel

    jkernel.enable_x64()
    t0 = time.perf_counter()
    say = log or (lambda m: None)
    runs = list(runs)
    if not runs:
        raise ValueError("fit_serving needs at least one run")
    kernels = dict(kernels or {})
    opened = {}
    for run in list(runs) + list(held):
        if run.label not in kernels:
            kernels[run.label] = run.kernel()
        opened[id(run)] = kernels[run.label]
    classes = {class_of(opened[id(r)]) for r in runs}
    if len(classes) != 1:
        raise ValueError("runs of one deployment class only (one chip, one engine version); "
                         f"got {sorted(map(str, classes))}")
    cls = classes.pop()
    k0 = opened[id(runs[0])]
    cand = [n for n in (names or SERVING_CONSTANTS) if n in k0.params]
    client = any(r.clock == "client" and r.fit_on for r in runs)
    frozen = {}
    if not client:
        for n in cand:
            if n in FRONT_END:
                frozen[n] = "no fit run is measured on the client's clock"
        cand = [n for n in cand if n not in frozen]
    start = {n: _start(k0, n) for n in cand}
    theta = np.log(np.array([start[n] for n in cand]))
    mu = np.array([math.log(PRIORS[n][0]) if PRIORS.get(n, (None,))[0] else theta[i]
                   for i, n in enumerate(cand)])
    sp = np.array([PRIORS.get(n, (None, math.log(3.0)))[1] for n in cand])
    segs = [s for r in runs for s in segments_of(r, sample=sample)]
    say(f"{cls}: {len(runs)} fit runs in {len(segs)} replays; candidates {', '.join(cand)}")
    fps = _replay_segments(segs, opened, cand, theta, say)
    replays = 1
    pred = _predicted(fps, runs, cand, theta, jac=True)
    rows, r, J = _residuals(runs, pred)
    reasons = _identifiable(J, cand, sp)
    for n, why in reasons.items():
        if why:
            frozen[n] = f"not identified by the fitted groups ({why})"
    names_fit = [n for n in cand if n not in frozen]
    keep = np.array([n in names_fit for n in cand])
    loss = _loss(r, theta[keep], mu[keep], sp[keep])
    history = [{"replay": 0, "loss": loss, "accepted": 1.0,
                "values": {n: float(np.exp(t)) for n, t in zip(cand, theta)}}]
    say(f"start: loss {loss:.3f} over {len(r)} residuals; fitting {', '.join(names_fit)}"
        + (f"; frozen: {', '.join(frozen)}" if frozen else ""))
    upper = np.array([math.log(UPPER[n]) if n in UPPER else np.inf for n in cand])
    for outer in range(max_outer):
        if not names_fit:
            break
        proposal = _inner(fps, runs, cand, theta, keep, mu, sp, upper)
        move = float(np.max(np.abs(proposal - theta))) if len(theta) else 0.0
        if move < TOLERANCE:
            say(f"iteration {outer + 1}: the fixed point moves {move:.4f} in log: converged")
            break
        accepted = 0.0
        for frac in (1.0, 0.5, 0.25):
            cand_theta = theta + frac * (proposal - theta)
            trial = _replay_segments(segs, opened, cand, cand_theta, None)
            replays += 1
            tr = _residuals(runs, _predicted(trial, runs, cand, cand_theta))[1]
            tl = _loss(tr, cand_theta[keep], mu[keep], sp[keep])
            say(f"iteration {outer + 1}: step × {frac:g}: replayed loss {tl:.3f} "
                f"(was {loss:.3f}); " + ", ".join(f"{n} {_fmt(n, math.exp(t))}"
                                                   for n, t in zip(cand, cand_theta)))
            if tl < loss:
                theta, fps, loss, accepted = cand_theta, trial, tl, frac
                break
        history.append({"replay": replays, "loss": loss, "accepted": accepted,
                        "values": {n: float(np.exp(t)) for n, t in zip(cand, theta)}})
        if not accepted:
            say(f"iteration {outer + 1}: no step lowers the replayed loss: stop")
            break
        if accepted == 1.0 and move < 3 * TOLERANCE:
            break
    # Laplace at the last fixed point, over the fitted names
    lap = None
    if names_fit:
        idx = np.flatnonzero(keep)
        pred = _predicted(fps, runs, cand, theta, jac=True)
        rows, r, J = _residuals(runs, pred)
        Jf = J[:, idx]
        prior = np.diag(1.0 / sp[idx] ** 2)
        lap = gauss_newton(lambda th: jnp.asarray(r) + jnp.asarray(Jf) @ (th - theta[idx]),
                           theta[idx], names_fit, to_value=jnp.exp, prior_precision=prior,
                           jacobian=Jf)
    values = {n: float(np.exp(t)) for n, t in zip(cand, theta)}
    table = evaluate(runs, held, opened, cand, None, theta, sample=sample, after_fps=fps,
                     log=say)
    deps = {r.label: describe(opened[id(r)]) for r in runs}
    return ServingFit(cls, tuple(names_fit), frozen, start, values, lap, runs, list(held),
                      table, history, replays, time.perf_counter() - t0,
                      [dict(run=k, **v) for k, v in deps.items()])


def _fmt(name: str, v: float) -> str:
    return f"{v:.4f}" if name == "compute_derate" else f"{v * 1e6:.2f} µs"


def _inner(fps, runs, names, theta, keep, mu, sp, upper, iterations: int = 12) -> np.ndarray:
    """Damped Gauss–Newton (IRLS for soft-L1) of the loss on the fixed points, over the
    kept names; returns the proposal θ."""
    th = np.array(theta, float)
    idx = np.flatnonzero(keep)
    lam = 1e-3
    cur = None
    for _ in range(iterations):
        pred = _predicted(fps, runs, names, th, jac=True)
        _, r, J = _residuals(runs, pred)
        if cur is None:
            cur = _loss(r, th[idx], mu[idx], sp[idx])
        z = r / SIGMA
        w = 1.0 / np.sqrt(1.0 + z * z)           # IRLS weights of soft-L1 at δ = 1
        Jk = J[:, idx] / SIGMA
        A = Jk.T @ (w[:, None] * Jk) + np.diag(1.0 / sp[idx] ** 2)
        b = Jk.T @ (w * z) + (th[idx] - mu[idx]) / sp[idx] ** 2
        improved = False
        for _ in range(8):
            step = -np.linalg.solve(A + lam * np.diag(np.diag(A)), b)
            trial = th.copy()
            trial[idx] = np.minimum(th[idx] + step, upper[idx])
            _, rt, _ = _residuals(runs, _predicted(fps, runs, names, trial))
            lt = _loss(rt, trial[idx], mu[idx], sp[idx])
            if lt < cur:
                th, cur, lam, improved = trial, lt, max(lam / 3, 1e-6), True
                break
            lam *= 10
        if not improved or np.max(np.abs(step)) < 1e-4:
            break
    return th


# --------------------------------------------------------------------------------------
# Evaluation: before and after, fit and held-out runs

def evaluate(runs, held, kernels: dict, names, before, after, *, sample: int = SAMPLE,
             after_fps=None, log=None) -> pd.DataFrame:
    """Per run and group: measured, before (``before`` θ; None: the kernels as shipped)
    and after (``after`` θ) mean TTFT, ITL and E2E with errors; ``kernels``: ``id(run)`` →
    kernel."""
    rows = []
    for split, group in (("fit", list(runs)), ("held-out", list(held))):
        if not group:
            continue
        segs = [s for r in group for s in segments_of(r, sample=sample)]
        b = _replay_segments(segs, kernels, names, before, None)
        a = after_fps if (split == "fit" and after_fps is not None) else \
            _replay_segments(segs, kernels, names, np.asarray(after), None)
        pb = _predicted(b, group, names, before)
        pa = _predicted(a, group, names, np.asarray(after))
        for (ri, g), (t, e, _, _) in sorted(pa.items()):
            run = group[ri]
            m = run.groups[g]
            tb, eb = pb.get((ri, g), (math.nan, math.nan, 0, 0))[:2]
            out1 = max(m.output_mean - 1.0, 1.0)
            row = {"source": run.source, "run": run.name, "group": m.label, "split": split,
                   "requests": m.requests, "fit_on": ",".join(run.fit_on),
                   **describe(kernels[id(run)])}
            for name, meas, vb, va in (("ttft_mean", m.ttft_mean_s, tb, t),
                                       ("itl_mean", m.itl_mean_s, (eb - tb) / out1,
                                        (e - t) / out1),
                                       ("e2e_mean", m.e2e_mean_s, eb, e)):
                row[f"{name}_measured"] = meas
                row[f"{name}_before"] = vb
                row[f"{name}_after"] = va
                row[f"{name}_error_before"] = vb / meas - 1
                row[f"{name}_error_after"] = va / meas - 1
            rows.append(row)
        if log:
            log(f"evaluated {split}: {len(group)} runs")
    return pd.DataFrame(rows)


def group_table(fit: ServingFit) -> pd.DataFrame:
    """The fit's per-group table (:func:`evaluate`)."""
    return fit.table
