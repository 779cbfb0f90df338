"""Fitting engine-level constants to serving measurements: the front end, host work per
step and per request, the compute derate.

A serving run (:mod:`jkernel.calibration.data.serving`) measures latencies, not steps: mean
TTFT and end-to-end latency per group of requests (a load stage), per request where the
client kept them. Through the replay (:func:`jkernel.replay.replay`) they are a function of
the kernel's constants, smooth where the batches stay the same and not where a changed step
cost reshapes the queue. The fit uses each where it holds:

**The fixed point, by gradient.** A replay run with ``record=True`` keeps every step's batch
and the steps that deliver each request's first and last token
(:class:`jkernel.replay.sim.StepRecord`). A request becomes ready ``admission_overhead``
after it arrives; the step of its engine running then has a part ``rho`` left, and the
engine runs its steps back to back until the request's first token, so its TTFT is
``admission + rho·d[start] + Σ d[start < s ≤ first] + output_token_overhead`` (E2E the same
to its last step, plus ``completion_overhead``). With the batches and each request's phase
``rho`` held, every group's mean TTFT and E2E is a differentiable function of the constants:
the step function's ``expected_s`` over the logged batches
(:func:`~jkernel.calibration.fit.traces.log_price`) and the front end's
``admission_overhead`` / ``output_token_overhead`` / ``completion_overhead``
(:mod:`jkernel.overheads`), which reproduces the replay at the constants it was replayed
with (to the microsecond ticks of the replay's clock). A request's admission moves its own
latency one for one, as it does on average over the phases at which requests arrive. The fit minimises, over ``θ = log``
of the fitted constants,

    L(θ) = Σ_groups Σ_{m ∈ fit_on} ρ(r_gm / σ) + ½ Σ_j ((θ_j − μ_j) / σ_p)²,
    r_g,ttft = log(TTFT_pred / TTFT_meas),   r_g,itl = log(ITL_pred / ITL_meas),

(ρ(z) = log(1 + z²), the Cauchy loss: quadratic within ±σ, and a group many σ off, a
replay that queues where the engine did not, weighs little and pulls less the further off
it is; σ = :data:`SIGMA`; log-normal priors of width ``σ_p``, :data:`PRIORS` and
:func:`priors`) by damped Gauss–Newton with the Cauchy weights (IRLS); the Jacobian is
``jax.jacfwd`` of the fixed-point function.

**The rest, derivative-free.** A new step cost changes the batches, and near a deployment's
knee the queue: that part of the dependence has no useful gradient (the schedule is a
discrete function of the step times). The outer loop replays at the proposed constants and
accepts them only if the *replayed* loss falls, halving the step up to twice otherwise (a
backtracking line search on the replay, which never differentiates the schedule); the
accepted replay is the next fixed point. It stops when a step moves no constant by more than
:data:`TOLERANCE` in log, after :data:`MAX_OUTER` replays of the fit runs, or when no step is
accepted. A run past its knee (a queue the replay builds and the engine did not, or the
reverse) is a regime miss, not a small error: its residual sits in ρ's flat tail, so it
neither steers the gradient nor decides the line search.

**Uncertainty** is the Laplace (Gauss–Newton) approximation of
:func:`~jkernel.calibration.fit.uncertainty.gauss_newton` at the last fixed point, with the
priors' precision. Which constants are fitted is decided twice, from the data: before the
fit, a constant whose effect on the groups the ones chosen before it (in :data:`ORDER`) and
the models' offsets (when asked for) already explain is left out (:func:`choose`); after it,
a constant the Laplace approximation does not pin (a data standard error above 0.5 in log
at the groups' robust residual scale, :func:`pinned`) goes back to its starting value and
the rest are fitted again, unless the data reject those starting values (a likelihood-ratio
test, :func:`start_rejected`: a start borrowed from another engine version or deployment
can be far from what these runs measure even where they do not pin the value), in which
case the fit keeps them where the data put them (``identifiable: false``: the Laplace
gives them no interval) and says so (``ServingFit.loose``); and step constants go back too where the fitted groups' ITLs
still scatter more than :data:`ACCEPT_SIGMA` around the fit (the laws' errors, not the
engine, set those steps). A constant left out keeps its starting value, and the fit says
why.

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
import re
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

from ..data.serving import ServingRun
from .traces import log_price, zero_scale
from .uncertainty import Laplace, gauss_newton

__all__ = ["SERVING_CONSTANTS", "FRONT_END", "STEP", "PRIORS", "SIGMA", "TOLERANCE",
           "MAX_OUTER", "TRANSIENT_MIN", "SAMPLE", "ORDER", "pinned", "start_rejected",
           "START_TEST_LEVEL", "ACCEPT_SIGMA", "STEP_BOUNDARIES",
           "FRONT_END_BOUNDARIES", "OLDEST", "version_ranges", "MODEL_SIGMA", "COLLINEAR", "family_of", "MEASURED_DERATE_SIGMA", "priors", "DeploymentClass", "class_of", "serving_classes", "choose",
           "Segment", "FixedPoint", "fixed_point", "segments_of", "replay_segment",
           "ServingFit", "fit_serving",
           "fit_classes",
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
#: value (the catalog's for the deployment). ``host_admission_per_request`` is centred on
#: the API server's 2 ms tokeniser batching window of vLLM 0.10–0.23, and
#: ``host_admission_per_token`` on the tokeniser's throughput on one core of a DGX H100,
#: about 1k tokens per ms (vllm-project/vllm#44172 and vllm-project/vllm#19012, docs/calibrate.md),
#: the rest of each unknown: a factor 3 either way. The compute derate is a chip's rate:
#: where whole steps measured it (the catalog's entry is ``fitted``) a serving fit, whose
#: groups mix it with every primitive law's error, may move it by about 5 %
#: (:data:`MEASURED_DERATE_SIGMA`), else by a factor 1.5.
PRIORS = {"host_serial": (None, math.log(3.0)), "host_serial_per_request": (None, math.log(3.0)),
          "compute_derate": (None, math.log(1.5)),
          "host_admission_per_request": (2e-3, math.log(3.0)),
          "host_admission_per_token": (1e-6, math.log(3.0))}
MEASURED_DERATE_SIGMA = math.log(1.05)
#: Upper bounds (SI) of fitted constants.
UPPER = {"compute_derate": 1.0}
#: The residual scale of the loss (log ratio): group means are trusted to about 3 %.
SIGMA = 0.03
#: Width (log) of a model's step offset (:class:`_Problem`): the primitive laws price a
#: model's steps within about 10 % (docs/calibrate.md, the profile fits' held-out errors).
MODEL_SIGMA = 0.10
#: The largest robust scatter (log) of the fitted groups' ITLs around a fit that keeps step
#: constants: where the ITLs still scatter more than this, the primitive laws' errors for
#: these models (not the engine) set the steps, and step constants fitted to them would
#: measure those errors, so :func:`fit_serving` puts them back to their starting values and
#: fits the front end alone. The front end, an additive time before the first step, is kept
#: wherever the fit pins it (its interval carries the groups' scatter).
ACCEPT_SIGMA = 0.08
#: Level of the likelihood-ratio test of :func:`start_rejected`.
START_TEST_LEVEL = 0.95
#: Outer-loop stop: the largest move of a fitted constant, in log.
TOLERANCE = 0.01
#: At most this many replays of the fit runs after the first (a fit that starts far from
#: its fixed point, as an older engine version from a newer one's step constants, needs
#: more than four to stop moving: docs/calibrate.md §3).
MAX_OUTER = 8
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


#: Releases at which vLLM changes what the constants measure (vllm-facts in docs/calibrate.md):
#: the step's host work changes when asynchronous scheduling became the default (0.14.0);
#: the front end when the API server's tokeniser batching window (2 ms) came (0.10.0) and
#: went (after 0.23; 0.24.0 is the first release that may lack it, unconfirmed).
STEP_BOUNDARIES = ("0.14.0",)
FRONT_END_BOUNDARIES = ("0.10.0", "0.24.0")
#: The oldest engine version jkernel's rules cover (documents/scenario.py ENGINE_VERSIONS).
OLDEST = "0.8.0"


def version_ranges(versions: Sequence[str], boundaries: Sequence[str]) -> dict:
    """The engine versions each fitted version's entry covers (a
    :class:`~jkernel.documents.coefficients.VersionRange` per version): from the start of
    its era (the last boundary at or below it, or the version itself when an older fit
    shares its era) up to the next fitted version's start; the oldest reaches down to
    :data:`OLDEST` and the newest is open above, so every version selects the nearest
    fitted entry, and provenance flags a version that is not a fitted one."""
    from jkernel.documents.coefficients import VersionRange
    from jkernel.documents.scenario import parse_version as pv

    vs = sorted(set(versions), key=pv)
    starts = []
    for i, v in enumerate(vs):
        if i == 0:
            starts.append(OLDEST)
            continue
        between = [b for b in boundaries if pv(vs[i - 1]) < pv(b) <= pv(v)]
        starts.append(between[-1] if between else v)
    return {v: VersionRange(starts[i], starts[i + 1] if i + 1 < len(vs) else None)
            for i, v in enumerate(vs)}


def class_of(kernel) -> DeploymentClass:
    sc = kernel.inputs.scenario
    return DeploymentClass(str(sc.cluster.hardware), str(sc.engine_version))


def serving_classes(runs: Sequence[ServingRun], kernels: dict | None = None) -> dict:
    """The runs grouped by deployment class (:func:`class_of`), in first-seen order;
    ``kernels`` (run label → kernel) is filled with each run's kernel as it is opened."""
    kernels = {} if kernels is None else kernels
    out: dict = {}
    for run in runs:
        if run.label not in kernels:
            kernels[run.label] = run.kernel()
        out.setdefault(class_of(kernels[run.label]), []).append(run)
    return out


_SIZE = re.compile(r"^\d+(\.\d+)?[bm]$")


def family_of(model: str) -> str:
    """A model's family for the reports: its name up to the parameter count
    (``llama-3.1-70b-instruct`` → ``llama-3.1``, ``qwen2.5-7b-instruct`` → ``qwen2.5``)."""
    parts = []
    for piece in model.lower().split("-"):
        if _SIZE.match(piece) or piece in ("instruct", "hf", "chat", "base"):
            break
        parts.append(piece)
    return "-".join(parts) or model


def describe(kernel) -> dict:
    """A kernel's deployment: chip, engine version, model, its family, tp (the report's
    columns)."""
    sc = kernel.inputs.scenario
    return {"chip": str(sc.cluster.hardware), "engine_version": str(sc.engine_version),
            "model": str(sc.model), "family": family_of(str(sc.model)),
            "tp": int(kernel.resolution().tensor_parallel())}


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
    warm_up = "warm_up" in df.columns and bool(df["warm_up"].any())
    if sample <= 0 or warm_up or all(m + s >= len(idx) for _, idx, m, s in plans):
        return [Segment(run, df, whole_pos, (whole_pos >= 0).astype(float))]
    out = []
    for i, idx, m, s in plans:
        n = len(idx)
        take = idx[:m + s]
        sub = df.iloc[take].reset_index(drop=True).drop(columns=["arrival_time_us"],
                                                         errors="ignore")
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
    start: jax.Array           # (K,) int: the step running when each counted request
                               # became ready (or the first after, the engine being idle)
    rho: jax.Array             # (K,) float: the part of that step still to run then
    prompt: jax.Array          # (K,) int
    first: jax.Array           # (K,) int: step of each counted request's first token
    last: jax.Array            # (K,) int
    weight: jax.Array          # (K,) float
    group: jax.Array           # (K,) int: position in the run's groups
    held_first: jax.Array      # (K,) float: the API server's waits in its TTFT, s (held)
    held_last: jax.Array       # (K,) float: the same in its E2E, s (held)


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


class _Shape(NamedTuple):
    """Padded sizes of a fixed point's arrays: steps, requests per step, counted requests,
    engines. Fixed points of one deployment share the largest, so their programs compile
    once (and again only when a replay outgrows a power of two)."""

    steps: int
    width: int
    counted: int
    engines: int

    def join(self, other: "_Shape") -> "_Shape":
        return _Shape(*(max(a, b) for a, b in zip(self, other)))


def _shape(kernel, result, segment: Segment) -> _Shape:
    from jkernel.batch import bucket_for

    rec = result.record
    R = bucket_for(max((len(s) for s in rec.scheduled), default=1), kernel.buckets)
    cnt = int(np.sum((segment.group_pos >= 0) & (rec.first_step >= 0) & (rec.last_step >= 0)))
    E = int(max(rec.engine, default=0)) + 1
    return _Shape(_pow2(len(rec.scheduled), 256), R, _pow2(cnt), E)


def _batches(scheduled, computed, pad, threshold: int, N: int, R: int) -> object:
    from jkernel.step import BatchArrays

    n = len(scheduled)
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
    return BatchArrays(S, C, M, np.full(N, threshold, np.int32), np.zeros(N, np.int32), P)


def fixed_point(segment: Segment, kernel, names: Sequence[str], result,
                shape: _Shape | None = None) -> FixedPoint:
    """The fixed-point arrays of ``segment`` replayed by ``kernel`` (``result``, a
    :class:`~jkernel.replay.ReplayResult` with its record).

    A counted request became ready at ``r = arrival + admission``; the step of its engine
    running then is ``start`` (the first step after, with nothing left of an earlier one,
    when the engine was idle), of which ``rho`` was still to run. Its first token ends step
    ``first``, so its TTFT is ``admission + rho·d[start] + Σ d over the engine's steps after
    start up to first + output_token_overhead``, plus what it waited on the API server's
    queue (:mod:`jkernel.replay.sim`; held like the batches, 0 where the server does no
    work): exactly the replay's at its constants, and with the batches, the phase ``rho``
    and those waits held, a smooth function of the constants."""
    from jkernel.replay.sim import ticks

    rec = result.record
    n = len(rec.scheduled)
    shape = shape or _shape(kernel, result, segment)
    N = shape.steps
    threshold = int(kernel.settings.decode_threshold)
    batches = _batches(rec.scheduled, rec.computed, rec.pad, threshold, N, shape.width)
    eng = np.asarray(rec.engine, np.int64)
    engines = int(eng.max()) + 1 if n else 1
    mask = np.zeros((shape.engines, N))
    for e in range(engines):
        mask[e, :n] = eng == e
    t0 = result.steps["start_s"].to_numpy(float)
    dur = result.steps["duration_s"].to_numpy(float)
    req = result.requests
    pos = segment.group_pos
    done = (rec.first_step >= 0) & (rec.last_step >= 0)
    cnt = np.flatnonzero((pos >= 0) & done)
    prompts = req["input_tokens"].to_numpy(np.int64)[cnt]
    adm = {int(p): ticks(kernel.admission_overhead(int(p))) / 1e6 for p in np.unique(prompts)}
    # the API server's queue (jkernel.replay.sim): waits held like the batches, 0 where it
    # does no work
    admit_wait = rec.admit_wait_us[cnt] / 1e6
    ready = (req["arrival_s"].to_numpy(float)[cnt] + np.array([adm[int(p)] for p in prompts])
             + admit_wait)
    first_s = rec.first_step[cnt]
    start = np.zeros(len(cnt), np.int64)
    rho = np.zeros(len(cnt))
    by_engine = {e: np.flatnonzero(eng == e) for e in range(engines)}
    for e, steps in by_engine.items():
        mine = np.flatnonzero(eng[first_s] == e)
        if not len(mine):
            continue
        ends = t0[steps] + dur[steps]
        # the step running at r (start ≤ r < end), or the first starting at or after r
        j = np.searchsorted(ends, ready[mine] + 1e-9, side="left")
        j = np.minimum(j, len(steps) - 1)
        s0 = steps[j]
        start[mine] = s0
        rho[mine] = np.clip((t0[s0] + dur[s0] - ready[mine]) / dur[s0], 0.0, 1.0)
    K = shape.counted

    def pad(x, dtype):
        out = np.zeros(K, dtype)
        out[:len(cnt)] = x
        return jnp.asarray(out)

    arrays = _Arrays(batches, jnp.asarray(mask), pad(start, np.int64), pad(rho, float),
                     pad(prompts, np.int64), pad(first_s, np.int64),
                     pad(rec.last_step[cnt], np.int64), pad(segment.weight[cnt], float),
                     pad(pos[cnt], np.int64),
                     pad(admit_wait + rec.first_wait_us[cnt] / 1e6, float),
                     pad(admit_wait + rec.last_wait_us[cnt] / 1e6, float))
    return FixedPoint(segment, kernel, tuple(names), arrays, len(segment.run.groups), result, n)


@functools.lru_cache(maxsize=64)
def _program(step_fn, names: tuple[str, ...], groups: int):
    """``(θ, base, arrays) → (Σw·ttft, Σw·e2e, Σw)`` per group, jitted, and the same with
    its Jacobian in θ (cached per step function, names and group count)."""
    from ... import overheads

    price = log_price(step_fn, "expected_s", names)

    def sums(theta, base, a: _Arrays):
        p = base.replace(**{n: jnp.exp(theta[i]) for i, n in enumerate(names)}) if names \
            else base
        d = jnp.exp(price(theta, base, [a.batches]))
        cum = jnp.sum(jnp.cumsum(d[None, :] * a.engine_mask, axis=1) * a.engine_mask, axis=0)
        wait = overheads.admission_overhead(p, a.prompt) + a.rho * d[a.start] - cum[a.start]
        ot = overheads.output_token_overhead(p)
        co = overheads.completion_overhead(p)
        ttft = wait + cum[a.first] + ot + a.held_first
        e2e = wait + cum[a.last] + ot + co + a.held_last
        seg = lambda x: jax.ops.segment_sum(x, a.group, num_segments=groups)  # noqa: E731
        return jnp.stack([seg(a.weight * ttft), seg(a.weight * e2e), seg(a.weight)])

    return (jax.jit(sums),
            jax.jit(lambda th, base, a: (sums(th, base, a), jax.jacfwd(sums)(th, base, a))))


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


def _residuals(runs, pred):
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


class _Problem:
    """The objective of one class's fit: residuals of the groups' fitted metrics, priors of
    the constants, and the models' step offsets.

    A model's primitive laws may price its steps a few per cent off whatever the engine
    constants are (a decode-attention rate, an MoE kernel); such an error is the laws'
    business, and an engine constant fitted to absorb it would move every other model's
    steps. So each model of the class has an offset ``u_m`` added to the log ITL residuals
    of its groups, with a normal prior of width :data:`MODEL_SIGMA`: an error common to the
    class's models goes to the engine constants, one particular to a model to its offset.
    The offsets are nuisance parameters: the kernel never prices with them. A class with one
    model has none: its engine constants and its one model's law error then cannot be told
    apart by level, and the constants carry both (the report says so)."""

    def __init__(self, runs, models: Sequence[str], mu, sp, upper):
        self.runs = list(runs)
        self.model_names = sorted(set(m for m in models if m))
        self.model_of = [self.model_names.index(m) if m else -1 for m in models]
        self.mu, self.sp, self.upper = mu, sp, upper

    def offsets_matrix(self, rows) -> np.ndarray:
        """(rows, models): 1 where an ITL row belongs to a model."""
        U = np.zeros((len(rows), len(self.model_names)))
        for i, row in enumerate(rows):
            if row.metric == "itl" and self.model_of[row.run] >= 0:
                U[i, self.model_of[row.run]] = 1.0
        return U

    def loss(self, r, theta, u, keep) -> float:
        """Cauchy loss of the residuals (offsets added) in units of σ, plus the priors."""
        z = np.asarray(r) / SIGMA
        data = float(np.sum(np.log1p(z ** 2)))
        prior = 0.5 * float(np.sum(((theta[keep] - self.mu[keep]) / self.sp[keep]) ** 2))
        return data + prior + 0.5 * float(np.sum((np.asarray(u) / MODEL_SIGMA) ** 2))

    def best_offsets(self, rows, r, u0=None, iterations: int = 30) -> np.ndarray:
        """The offsets minimising the loss for fixed constants (IRLS, per model)."""
        U = self.offsets_matrix(rows)
        u = np.zeros(U.shape[1]) if u0 is None else np.array(u0, float)
        for _ in range(iterations):
            z = (r + U @ u) / SIGMA
            w = 2.0 / (1.0 + z * z)
            A = (U.T * w) @ U / SIGMA ** 2 + np.eye(len(u)) / MODEL_SIGMA ** 2
            g = (U.T * w) @ (r + U @ u) / SIGMA ** 2 + u / MODEL_SIGMA ** 2
            step = np.linalg.solve(A, g)
            u = u - step
            if np.max(np.abs(step), initial=0.0) < 1e-6:
                break
        return u

    def replayed_loss(self, rows, r, theta, keep, u0=None) -> tuple[float, np.ndarray]:
        """The loss of a replay's residuals, at the offsets that suit them best."""
        u = self.best_offsets(rows, r, u0)
        return self.loss(r + self.offsets_matrix(rows) @ u, theta, u, keep), u


def _inner(fps, prob: _Problem, names, theta, keep, u, iterations: int = 12):
    """Damped Gauss–Newton (IRLS for the Cauchy loss) on the fixed points, over the kept
    constants and the models' offsets; returns the proposal ``(θ, u)``."""
    runs = prob.runs
    th = np.array(theta, float)
    u = np.array(u, float)
    idx = np.flatnonzero(keep)
    lam = 1e-3
    cur = None
    nu = len(u)
    for _ in range(iterations):
        pred = _predicted(fps, runs, names, th, jac=True)
        rows, r, J = _residuals(runs, pred)
        U = prob.offsets_matrix(rows)
        if cur is None:
            cur = prob.loss(r + U @ u, th, u, keep)
        z = (r + U @ u) / SIGMA
        w = 2.0 / (1.0 + z * z)
        X = np.hstack([J[:, idx], U]) / SIGMA
        prior_p = np.concatenate([1.0 / prob.sp[idx] ** 2, np.full(nu, 1.0 / MODEL_SIGMA ** 2)])
        A = X.T @ (w[:, None] * X) + np.diag(prior_p)
        g = X.T @ (w * z) + np.concatenate([(th[idx] - prob.mu[idx]) / prob.sp[idx] ** 2,
                                            u / MODEL_SIGMA ** 2])
        improved = False
        step = np.zeros(len(g))
        for _ in range(8):
            step = -np.linalg.solve(A + lam * np.diag(np.diag(A)), g)
            trial = th.copy()
            trial[idx] = np.minimum(th[idx] + step[:len(idx)], prob.upper[idx])
            tu = u + step[len(idx):]
            rows_t, rt, _ = _residuals(runs, _predicted(fps, runs, names, trial))
            lt = prob.loss(rt + prob.offsets_matrix(rows_t) @ tu, trial, tu, keep)
            if lt < cur:
                th, u, cur, lam, improved = trial, tu, lt, max(lam / 3, 1e-6), True
                break
            lam *= 10
        if not improved or np.max(np.abs(step)) < 1e-4:
            break
    return th, u


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


def replay_segment(segment: Segment, kernel, *, record: bool = False):
    """``segment``'s requests replayed on ``kernel`` (a ``ReplayResult``); the run's
    closed-loop clients drive it when the segment is the whole run."""
    from jkernel.replay import replay

    whole = len(segment.requests) == len(segment.run.requests)
    return replay(kernel, segment.requests, record=record,
                  clients=segment.run.clients if whole else None)


def _replay_segments(segments: Sequence[Segment], kernels: dict, names, theta,
                     log: Callable[[str], None] | None = None) -> list[FixedPoint]:
    done = []
    shapes: dict = {}
    for seg in segments:
        base = kernels[id(seg.run)]
        k = _kernel_at(base, names, theta, seg.run.clock)
        res = replay_segment(seg, k, record=True)
        sh = _shape(k, res, seg)
        key = (k.step_fn, seg.run.clock, len(seg.run.groups))
        shapes[key] = shapes[key].join(sh) if key in shapes else sh
        done.append((seg, k, res, key))
    out = []
    for seg, k, res, key in done:
        seg_names = () if theta is None else tuple(
            n for n in names if not (seg.run.clock == "engine" and n in FRONT_END))
        out.append(fixed_point(seg, k, seg_names, res, shapes[key]))
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
      deployments: each fit run's chip, engine version, model and tp (the provenance).
      offsets: each model's step offset (log, a nuisance of the fit: :class:`_Problem`).
      scatter: per fitted metric (``ttft``, ``itl``), the robust scatter (log) of the fit
        groups' residuals at the fit: 1.4826 × their median absolute value.
      loose: fitted constants the groups do not pin but whose starting values they reject
        (:func:`start_rejected`), with the test's figures: kept at the fitted value, with
        ``identifiable`` false and no interval (the Laplace does not pin them).
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
    offsets: dict = field(default_factory=dict)
    scatter: dict = field(default_factory=dict)
    loose: dict = field(default_factory=dict)

    def ci95(self, name: str):
        if self.laplace is None or name not in self.laplace.names:
            return None
        return self.laplace.ci95[name]

    @property
    def sigma(self) -> float:
        """The fitted groups' robust residual scale at the fit (log; nan without a fit)."""
        return float(self.laplace.sigma) if self.laplace is not None else math.nan

    def taken(self) -> tuple[str, ...]:
        """The fitted constants the catalog takes: every one the fit kept. (Step constants
        whose fitted groups' ITLs scatter more than :data:`ACCEPT_SIGMA` around the fit
        are not kept: :func:`fit_serving` puts them back and refits the rest.)"""
        return tuple(self.names)

    @property
    def accepted(self) -> bool:
        """Whether the catalog takes any of the fitted constants (:meth:`taken`)."""
        return bool(self.taken())

    def verdict(self) -> str:
        """What the catalog takes of the fit, in words."""
        if not self.names:
            return "nothing identified: no constant written"
        itl = self.scatter.get("itl", math.nan)
        return (f"taken: {', '.join(self.names)} (fitted groups' scatter in log: "
                + ", ".join(f"{m} {v:.3f}" for m, v in self.scatter.items()) + ")"
                + ("" if all(n in FRONT_END for n in self.names) or not math.isfinite(itl)
                   else f"; step constants kept as ITL scatter ≤ {ACCEPT_SIGMA}")
                + "".join(f"; {n} not pinned but kept: {why}" for n, why in self.loose.items()))


def priors(kernel, names: Sequence[str], theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The log-normal priors' centres and widths (log) of ``names`` on ``kernel``'s
    deployment (:data:`PRIORS`; the compute derate's width by its catalog method)."""
    methods = {p.name: p.method for p in kernel.provenance()}
    mu, sp = [], []
    for i, n in enumerate(names):
        centre, width = PRIORS.get(n, (None, math.log(3.0)))
        if n == "compute_derate" and methods.get(n) == "fitted":
            width = MEASURED_DERATE_SIGMA
        mu.append(math.log(centre) if centre else float(theta[i]))
        sp.append(width)
    return np.array(mu), np.array(sp)


def _start(kernel, name: str) -> float:
    v = float(kernel.params[name]) if name in kernel.params else 0.0
    return v if v > 0 else zero_scale(name) if name in STEP else PRIORS.get(name, (1e-6,))[0]


#: The order in which constants join a fit (:func:`choose`): the one the data measure most
#: directly first. Where two move the groups alike (a fixed front end and one per prompt
#: token when every prompt is about as long), the earlier one is fitted and the later one
#: keeps its starting value.
ORDER = ("host_admission_per_request", "host_serial", "compute_derate",
         "host_serial_per_request", "host_admission_per_token")


#: R² above which a constant's Jacobian column counts as explained by the columns chosen
#: before it (:func:`choose`; the rule of :mod:`~jkernel.calibration.fit.stepfit`).
COLLINEAR = 0.98


def _r2(y: np.ndarray, X: np.ndarray) -> float:
    """Share of ``y``'s variation about 0 that least squares on ``X``'s columns explains."""
    if X.shape[1] == 0 or not np.any(y):
        return 0.0 if np.any(y) else 1.0
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    return float(1.0 - np.sum((y - X @ coef) ** 2) / np.sum(y ** 2))


def choose(J: np.ndarray, names: Sequence[str], U: np.ndarray | None = None
           ) -> dict[str, str]:
    """Which of ``names`` the groups can tell apart, before the fit: on the Jacobian ``J``
    of the residuals at the first fixed point, candidates join in :data:`ORDER`, and one
    whose column the columns chosen before it and the models' offsets (``U``) explain
    (R² above :data:`COLLINEAR`) or which moves no fitted group is left out. How precisely
    the groups pin a chosen constant is judged after the fit (:func:`_laplace`), at the
    value it is fitted to. Name → "" (chosen) or why not."""
    names = list(names)
    if J.size == 0:
        return {n: "no fitted group measures it" for n in names}
    U = np.zeros((J.shape[0], 0)) if U is None else U
    out: dict[str, str] = {}
    chosen: list[int] = []
    for n in sorted(names, key=lambda x: ORDER.index(x) if x in ORDER else len(ORDER)):
        i = names.index(n)
        col = J[:, i]
        if not np.any(np.abs(col) > 1e-9):
            out[n] = "no curvature: it moves no fitted group"
            continue
        r2 = _r2(col, np.hstack([J[:, chosen], U]))
        if r2 > COLLINEAR:
            others = [names[c] for c in chosen] + (["the models' offsets"] if U.shape[1]
                                                   else [])
            out[n] = (f"collinear (R² {r2:.3f}) with " + ", ".join(others))
            continue
        chosen.append(i)
        out[n] = ""
    return out


def pinned(J: np.ndarray, names: Sequence[str], U: np.ndarray | None = None, *,
           sigma: float = SIGMA, max_se: float = 0.5, rcond: float = 1e-9,
           null_loading: float = 0.05) -> dict[str, str]:
    """Which of ``names`` the groups pin at the fit (the rule of
    :func:`~jkernel.calibration.fit.uncertainty.gauss_newton`: no null direction and a data
    standard error of at most ``max_se`` in log, at residual scale ``sigma``), on the
    Jacobian ``J`` at the fitted point with the models' offsets (columns ``U``, their prior
    :data:`MODEL_SIGMA`) marginalised: constants join in :data:`ORDER` and one stays only if
    every constant chosen so far stays pinned with it. The constants' own priors play no
    part. Name → "" (pinned) or why not."""
    names = list(names)
    U = np.zeros((J.shape[0], 0)) if U is None else U
    Huu = U.T @ U / sigma ** 2 + np.eye(U.shape[1]) / MODEL_SIGMA ** 2

    def verdict(cols):
        Jc = J[:, cols]
        H = Jc.T @ Jc / sigma ** 2
        if U.shape[1]:
            Hcu = Jc.T @ U / sigma ** 2
            H = H - Hcu @ np.linalg.solve(Huu, Hcu.T)
        w, V = np.linalg.eigh(H)
        top = float(np.max(w)) if w.size else 0.0
        null = w <= rcond * top if top > 0 else np.ones_like(w, bool)
        loading = np.sum(V[:, null] ** 2, axis=1) if null.any() else np.zeros(len(cols))
        inv = np.where(null, 0.0, 1.0 / np.where(null, 1.0, w))
        se = np.sqrt(np.maximum(np.diag((V * inv) @ V.T), 0.0))
        return ["no curvature" if loading[i] > null_loading else
                f"ill-conditioned (data standard error {se[i]:.2f} in log)"
                if se[i] > max_se else "" for i in range(len(cols))]

    out: dict[str, str] = {}
    chosen: list[int] = []
    for n in sorted(names, key=lambda x: ORDER.index(x) if x in ORDER else len(ORDER)):
        i = names.index(n)
        why = verdict(chosen + [i])
        if not any(why):
            chosen.append(i)
            out[n] = ""
        else:
            others = [names[c] for c in chosen]
            out[n] = (why[-1] or "it unpins " + ", ".join(
                names[c] for c, w in zip(chosen, why) if w)) + (
                f"; with {', '.join(others)}" if others else "")
    return out


def fit_classes(runs: Sequence[ServingRun], *, kernels: dict | None = None,
                names_for: Callable | None = None, log: Callable[[str], None] | None = None,
                **options) -> list:
    """:func:`fit_serving` of every deployment class of ``runs`` that has fit runs: per chip
    from the newest engine version down, each class starting from the step constants the
    newer class's fit on that chip took (an older version whose own fit does not take a
    step constant borrows the nearest newer fitted entry once they are written,
    :func:`version_ranges`, so that value, not the one the catalog held before, is where its
    fit starts). ``names_for(cls, fit_runs)``: the names to fit for a class (None: every
    serving constant); ``options``: passed on to :func:`fit_serving`. Returns the fits."""
    from jkernel.documents.scenario import parse_version

    kernels = {} if kernels is None else kernels
    say = log or (lambda m: None)
    classes = serving_classes(runs, kernels)
    nearer: dict = {}                   # chip → the step constants its newest fit took
    fits = []
    for cls in sorted(classes, key=lambda c: (c.hardware, parse_version(c.engine_version)),
                      reverse=True):
        members = classes[cls]
        fit_runs = [r for r in members if r.split == "fit" and r.fit_on]
        held = [r for r in members if r.split == "held-out"]
        if not fit_runs:
            say(f"{cls}: held-out runs only: not fitted")
            continue
        names = names_for(cls, fit_runs) if names_for is not None else None
        fit = fit_serving(fit_runs, names, held=held, log=log, kernels=kernels,
                          start=nearer.get(cls.hardware), **options)
        say(f"{cls}: {fit.verdict()}")
        fits.append(fit)
        carried = {n: fit.values[n] for n in fit.taken() if n in STEP}
        if carried:
            nearer[cls.hardware] = {**nearer.get(cls.hardware, {}), **carried}
    return fits


def start_rejected(loss_fitted: float, loss_back: float, k: int, sigma: float
                   ) -> tuple[bool, float, float]:
    """Whether the fitted groups reject ``k`` constants' starting values: the
    likelihood-ratio test of the fit with them back at their starts (replayed loss
    ``loss_back``, the rest refitted) against the fit that moved them (``loss_fitted``),
    at level :data:`START_TEST_LEVEL`. The loss (:meth:`_Problem.loss`) is a negative log
    likelihood at the residual scale :data:`SIGMA`; the groups scatter by ``sigma`` (their
    robust scale, at least :data:`SIGMA`), so the statistic is taken at that scale:
    ``2 · Δloss · (SIGMA / sigma)²`` against χ²(k). Returns ``(rejected, statistic,
    critical value)``.

    A constant the groups do not pin may still be one whose start they rule out: a value
    borrowed from another engine version can sit where these runs' replays queue, or miss
    every group's slope, while the runs bound it only loosely from the other side."""
    from scipy.stats import chi2

    if k <= 0:
        return False, 0.0, math.inf
    scale = (SIGMA / max(float(sigma), SIGMA)) ** 2
    stat = 2.0 * (float(loss_back) - float(loss_fitted)) * scale
    crit = float(chi2.ppf(START_TEST_LEVEL, k))
    return bool(stat > crit), stat, crit


def fit_serving(runs: Sequence[ServingRun], names: Sequence[str] | None = None, *,
                held: Sequence[ServingRun] = (), sample: int = SAMPLE,
                max_outer: int = MAX_OUTER, log: Callable[[str], None] | None = None,
                kernels: dict | None = None, evaluate_after: bool = True,
                model_offsets: bool = False, start: dict | None = None) -> ServingFit:
    """Fit ``names`` (default: :data:`SERVING_CONSTANTS`) to the ``runs`` of one
    deployment class (module docstring), and evaluate before and after on ``runs`` and
    ``held`` (``evaluate_after`` False: no evaluation). ``kernels``: run label → its
    kernel, when already open. ``model_offsets``: give each model a step offset
    (:class:`_Problem`); off by default, because an offset also absorbs what a per-step
    constant does to that model's ITL, leaving the constant to the TTFTs alone.
    ``start``: name → SI value to start from (and centre the prior on) instead of the
    catalog's value for the deployment (what a neighbouring class's fit will make the
    catalog borrow here once it is written)."""
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
    unknown = [n for n in (names or ()) if n not in SERVING_CONSTANTS]
    if unknown:
        raise ValueError(f"not a serving constant: {', '.join(unknown)}; allowed: "
                         + ", ".join(SERVING_CONSTANTS))
    cand = [n for n in (names or SERVING_CONSTANTS) if n in k0.params]
    frozen = {}
    if not any(r.clock == "client" and r.fit_on for r in runs):
        for n in cand:
            if n in FRONT_END:
                frozen[n] = "no fit run is measured on the client's clock"
    over = dict(start or {})
    bad = [n for n, v in over.items() if not (n in SERVING_CONSTANTS and float(v) > 0)]
    if bad:
        raise ValueError(f"start: {', '.join(bad)}: a serving constant with a positive "
                         "value is required; allowed: " + ", ".join(SERVING_CONSTANTS))
    start = {n: float(over[n]) if n in over else _start(k0, n) for n in cand}
    theta = np.log(np.array([start[n] for n in cand]))
    mu, sp = priors(k0, cand, theta)
    upper = np.array([math.log(UPPER[n]) if n in UPPER else np.inf for n in cand])
    models = [describe(opened[id(r)])["model"] for r in runs]
    if not model_offsets or len(set(models)) < 2:
        models = [""] * len(models)          # no offsets (see _Problem)
    prob = _Problem(runs, models, mu, sp, upper)
    segs = [s for r in runs for s in segments_of(r, sample=sample)]
    say(f"{cls}: {len(runs)} fit runs in {len(segs)} replays; candidates {', '.join(cand)}")
    fps = _replay_segments(segs, opened, cand, theta, say)
    rows, r, J = _residuals(runs, _predicted(fps, runs, cand, theta, jac=True))
    free = [n for n in cand if n not in frozen]
    col = [cand.index(n) for n in free]
    for n, why in choose(J[:, col] if J.size else J, free, prob.offsets_matrix(rows)).items():
        if why:
            frozen[n] = f"not identified by the fitted groups ({why})"
    names_fit = [n for n in cand if n not in frozen]
    keep = np.array([n in names_fit for n in cand])
    history: list = []
    replays = [1]

    def descend(theta, fps, keep):
        """The outer loop (module docstring) over the kept constants."""
        rows, r, _ = _residuals(runs, _predicted(fps, runs, cand, theta))
        loss, u = prob.replayed_loss(rows, r, theta, keep)
        history.append({"replay": replays[0], "loss": loss, "accepted": 1.0,
                        "values": {n: float(np.exp(t)) for n, t in zip(cand, theta)}})
        say(f"loss {loss:.3f} over {len(r)} residuals; fitting "
            + ", ".join(n for n, k in zip(cand, keep) if k)
            + (f"; frozen: {', '.join(frozen)}" if frozen else ""))
        for outer in range(max_outer):
            if not keep.any():
                break
            proposal, pu = _inner(fps, prob, cand, theta, keep, u)
            move = float(np.max(np.abs(proposal - theta)))
            if move < TOLERANCE:
                say(f"iteration {outer + 1}: the fixed point moves {move:.4f} in log: "
                    "converged")
                break
            accepted = 0.0
            for frac in (1.0, 0.5, 0.25):
                trial_theta = theta + frac * (proposal - theta)
                trial = _replay_segments(segs, opened, cand, trial_theta, None)
                replays[0] += 1
                tr_rows, tr, _ = _residuals(runs, _predicted(trial, runs, cand, trial_theta))
                tl, tu = prob.replayed_loss(tr_rows, tr, trial_theta, keep, pu)
                say(f"iteration {outer + 1}: step × {frac:g}: replayed loss {tl:.3f} "
                    f"(was {loss:.3f}); " + ", ".join(f"{n} {_fmt(n, math.exp(t))}"
                                                       for n, t in zip(cand, trial_theta)))
                if tl < loss:
                    theta, fps, loss, u, accepted = trial_theta, trial, tl, tu, frac
                    break
            history.append({"replay": replays[0], "loss": loss, "accepted": accepted,
                            "values": {n: float(np.exp(t)) for n, t in zip(cand, theta)}})
            if not accepted:
                say(f"iteration {outer + 1}: no step lowers the replayed loss: stop")
                break
            if accepted == 1.0 and move < 3 * TOLERANCE:
                break
        return theta, fps, u

    theta, fps, u = descend(theta, fps, keep)
    lap = _laplace(fps, prob, cand, theta, keep, u) if keep.any() else None
    dropped = {}
    if lap is not None and not all(lap.identifiable[n] for n in names_fit):
        # constants the fitted groups do not pin at the fit (the data's own scatter, σ̂)
        # keep their starting values, chosen again in ORDER at the fitted point; the
        # others are fitted again without them
        rows, r, J = _residuals(runs, _predicted(fps, runs, cand, theta, jac=True))
        idx = [cand.index(n) for n in names_fit]
        verdict = pinned(J[:, idx], names_fit, prob.offsets_matrix(rows), sigma=lap.sigma)
        dropped = {n: why for n, why in verdict.items() if why}
    def scatter_of(fps, theta) -> dict:
        rows, r, _ = _residuals(runs, _predicted(fps, runs, cand, theta))
        return {m: 1.4826 * float(np.median(np.abs([x for x, row in zip(r, rows)
                                                   if row.metric == m])))
                for m in sorted({row.metric for row in rows})}

    def loss_at(fps, theta, keep, u) -> float:
        rows, r, _ = _residuals(runs, _predicted(fps, runs, cand, theta))
        return prob.replayed_loss(rows, r, theta, keep, u)[0]

    def snapshot():
        return theta.copy(), fps, u, lap, list(names_fit), keep.copy(), dict(frozen)

    def restore(state):
        nonlocal theta, fps, u, lap, names_fit, keep
        theta, fps, u, lap, names_fit, keep = (state[0].copy(), state[1], state[2], state[3],
                                               list(state[4]), state[5].copy())
        frozen.clear()
        frozen.update(state[6])

    def refit_without(drop: dict, why_all: str):
        """Back to their starting values, and the rest fitted again."""
        nonlocal theta, fps, u, lap, names_fit, keep
        for n, why in drop.items():
            frozen[n] = why
            theta[cand.index(n)] = math.log(start[n])
        names_fit = [n for n in names_fit if n not in drop]
        keep = np.array([n in names_fit for n in cand])
        say(f"{why_all}: {', '.join(drop)}: back to their starting values, the rest fitted "
            "again")
        fps = _replay_segments(segs, opened, cand, theta, say)
        replays[0] += 1
        theta, fps, u = descend(theta, fps, keep)
        lap = _laplace(fps, prob, cand, theta, keep, u) if keep.any() else None

    loose: dict = {}
    if dropped:
        why_not = {n: f"not identified at the fit ({why}, at the residual scale "
                      f"{lap.sigma:.3f} of the fitted groups)" for n, why in dropped.items()}
        moved = snapshot()            # the fit that moved them
        loss_moved, sigma = loss_at(fps, theta, keep, u), lap.sigma

        def put_back(names) -> tuple[bool, float, float]:
            """Refit with ``names`` at their starts; whether the groups reject that."""
            refit_without({n: why_not[n] for n in names}, "not identified at the fit")
            return start_rejected(loss_moved, loss_at(fps, theta, moved[5], u), len(names),
                                  sigma)

        rejected, stat, crit = put_back(list(dropped))
        if rejected:
            # which starts do the groups rule out? Each is put back alone, the one the
            # data measure least directly first (ORDER reversed), and stays back where
            # the groups accept it with those already back
            restore(moved)
            back: list = []
            verdict = {n: (stat, crit, len(dropped)) for n in dropped}
            for n in sorted(dropped, key=lambda x: ORDER.index(x) if x in ORDER else -1,
                            reverse=True):
                if len(back) + 1 == len(dropped):
                    break                 # every one back: rejected above
                before = snapshot()
                rej, st, cr = put_back(back + [n])
                if rej:
                    restore(before)
                    verdict[n] = (st, cr, len(back) + 1)
                else:
                    back.append(n)
            for n in dropped:
                if n in back:
                    continue
                st, cr, k = verdict[n]
                loose[n] = (f"{dropped[n]}, but the groups reject its start "
                            f"{_fmt(n, start[n])} (likelihood ratio {st:.1f} > {cr:.1f}, "
                            f"χ²({k}) at {START_TEST_LEVEL:g}, at the residual scale "
                            f"{sigma:.3f})")
            say("the groups reject the starting values of " + ", ".join(loose)
                + ": kept where the fit put them"
                + (f"; back at their starts: {', '.join(back)}" if back else ""))
    scatter = scatter_of(fps, theta)
    steps = [n for n in names_fit if n not in FRONT_END]
    if steps and scatter.get("itl", math.inf) > ACCEPT_SIGMA:
        refit_without({n: f"not taken: the fitted groups' ITLs scatter "
                          f"{scatter.get('itl', math.inf):.3f} in log around the fit (above "
                          f"{ACCEPT_SIGMA}): the laws' errors for these models, not the "
                          "engine, set the steps" for n in steps}, "not taken")
        scatter = scatter_of(fps, theta)
        loose = {n: why for n, why in loose.items() if n in names_fit}
    replays = replays[0]
    values = {n: float(np.exp(t)) for n, t in zip(cand, theta)}
    offsets = {m: float(x) for m, x in zip(prob.model_names, u)}
    table = (evaluate(runs, held, opened, cand, None, theta, sample=sample, after_fps=fps,
                      log=say) if evaluate_after else pd.DataFrame())
    deps = {r.label: describe(opened[id(r)]) for r in runs}
    return ServingFit(cls, tuple(names_fit), frozen, start, values, lap, runs, list(held),
                      table, history, replays, time.perf_counter() - t0,
                      [dict(run=k, **v) for k, v in deps.items()], offsets, scatter, loose)


def _laplace(fps, prob: _Problem, cand, theta, keep, u) -> Laplace:
    """The Gauss–Newton approximation at the last fixed point over the fitted constants and
    the models' offsets, with the priors' precision; the residual scale is the robust one
    of the groups (1.4826 × the median absolute residual, offsets removed, at least
    :data:`SIGMA`), so a constant counts as identified only where the groups' own scatter
    pins it."""
    idx = np.flatnonzero(keep)
    rows, r, J = _residuals(prob.runs, _predicted(fps, prob.runs, cand, theta, jac=True))
    U = prob.offsets_matrix(rows)
    X = np.hstack([J[:, idx], U])
    base = np.concatenate([theta[idx], u])
    names = [cand[i] for i in idx] + [f"offset:{m}" for m in prob.model_names]
    prior = np.diag(np.concatenate([1.0 / prob.sp[idx] ** 2,
                                    np.full(len(u), 1.0 / MODEL_SIGMA ** 2)]))
    res0 = r + U @ u
    sigma = max(SIGMA, 1.4826 * float(np.median(np.abs(res0)))) if len(res0) else SIGMA
    n = len(idx)
    return gauss_newton(lambda th: jnp.asarray(res0) + jnp.asarray(X) @ (th - base), base,
                        names, prior_precision=prior, jacobian=X, sigma=sigma,
                        to_value=lambda th: jnp.concatenate([jnp.exp(th[:n]), th[n:]]))


def _fmt(name: str, v: float) -> str:
    return f"{v:.4f}" if name == "compute_derate" else f"{v * 1e6:.2f} µs"


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
