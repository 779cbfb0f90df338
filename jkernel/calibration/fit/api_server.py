"""Fitting the API server's work from serving runs: what one request's admission and one
streamed token occupy the server process for (``host_api_server_per_request``,
``host_api_server_per_token``; the queue they make is :mod:`jkernel.replay.sim`'s).

Their effect is the queue on one process: nothing while it is idle, then a TTFT that grows
with the load once the streaming of a step's tokens and the admissions fill it. That is a
function of the schedule with no useful gradient (the serving fit's fixed point holds the
waits it replayed: :func:`jkernel.calibration.fit.serving.fixed_point`), so the two are
fitted derivative-free on a grid, searched one axis at a time (the time per token with no
time per request, upwards until the loss has risen twice; then the time per request at the
best of those; the token times next to the best point; then halfway to its neighbours on
each axis). Every point tried is replayed on the class's fit runs (the same sampled
segments as the serving fit, at its fitted constants), the front end's fixed
delay lowered by the common shift ``Δ ≤ 0`` that fits the point best (a one-dimensional
search: the work adds to every request's latency, its own tokens' streaming even on an idle
server, so the rest of the front end is less than the delay fitted without it), and the
point with the least loss is taken. The loss is a Cauchy negative log likelihood, as the
serving fit's, of the log ratios of every fit group's mean TTFT (whatever the run's
``fit_on``: the queue is seen in the TTFT) and of the fitted ITLs, each metric's scale
profiled out (:func:`cauchy_nll`): a group's TTFT near a knee scatters by tens of per cent
from one load to the next, far more than the 3 % the serving fit's loss is scaled to.

The grid point is kept only where the groups reject no work at all (both 0): the
likelihood-ratio statistic ``2·(loss at 0 − least loss)`` against χ²(2) at
:data:`START_TEST_LEVEL`. The 95 % interval of each is the profile over the grid: the grid
values whose best loss is within χ²(1, 0.95) / 2 of the least, widened to the nearest values
tried outside them (the bound is crossed somewhere between); as coarse as the grid. The
caller then refits the serving constants with the work in the kernels (``regenerate``),
whose fixed point holds the new waits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .serving import START_TEST_LEVEL, Segment, replay_segment, segments_of

__all__ = ["TOKEN_GRID_S", "REQUEST_GRID_S", "MIN_GROUPS", "MIN_SCALE", "ApiServerFit",
           "fit_api_server", "refit_with_api_server", "group_means", "shifted_loss",
           "cauchy_nll"]

#: The API server's time per streamed token tried, s. vLLM's Python server detokenises,
#: builds and writes one response chunk per token; the spec's reference value for that work
#: is 45.9 µs (``host_output_token`` in catalog/coefficients/cost-model-host-overheads.yaml),
#: and the grid reaches well past it either way.
TOKEN_GRID_S = (0.0, 50e-6, 100e-6, 150e-6, 200e-6, 300e-6)
#: Its time per request admitted tried, s (capped at the front end's delay, which it is
#: part of).
REQUEST_GRID_S = (0.0, 2e-3, 5e-3, 10e-3)
#: The fewest groups with a TTFT a fit needs: the shift, the two times and the TTFT's scale
#: are fitted to them, so fewer would fit any point exactly and tell nothing.
MIN_GROUPS = 5
#: The smallest scale of a metric's log ratios the likelihood allows: a group's mean is not
#: measured better than about half a per cent.
MIN_SCALE = 5e-3


@dataclass
class ApiServerFit:
    """Result of :func:`fit_api_server` for one deployment class.

    Attributes:
      per_request_s, per_token_s: the work taken (0 and 0 when none is kept);
      shift_s: the front end's fixed delay shift ``Δ`` fitted with them (s);
      kept: whether the groups reject no work (the likelihood-ratio test of the module
        docstring), with ``test``: ``(statistic, critical value)``;
      ci95: name → (low, high) on the grid (profile), for the kept constants;
      losses: one row per grid point: ``(per_request_s, per_token_s, shift_s, loss)``;
      sigma: the groups' robust scatter (log) at the best point; ``replays``; ``wall_s``;
      reason: why no work could be fitted ("" when the grid was searched).
    """

    per_request_s: float
    per_token_s: float
    shift_s: float
    kept: bool
    test: tuple
    ci95: dict
    losses: list
    sigma: float
    replays: int = 0
    wall_s: float = 0.0
    runs: list = field(default_factory=list)
    reason: str = ""

    def values(self) -> dict:
        """The constants to write, SI: empty when no work is kept."""
        if not self.kept:
            return {}
        return {"host_api_server_per_request": self.per_request_s,
                "host_api_server_per_token": self.per_token_s}


def group_means(segments: Sequence[Segment], results: Sequence) -> dict:
    """Per ``(run index, group)``: the replayed groups' weighted mean TTFT and E2E (s),
    from the segments and their replays (``ReplayResult`` in segment order); run index is
    the position of the segment's run among the distinct runs, in order met."""
    acc: dict = {}
    order: dict = {}
    for seg, res in zip(segments, results):
        r = order.setdefault(id(seg.run), len(order))
        req = res.requests
        ttft = req["ttft_s"].to_numpy(float)
        e2e = req["e2e_s"].to_numpy(float)
        ok = (seg.group_pos >= 0) & np.isfinite(ttft) & np.isfinite(e2e)
        for g in np.unique(seg.group_pos[ok]):
            m = ok & (seg.group_pos == g)
            w = seg.weight[m]
            a = acc.setdefault((r, int(g)), np.zeros(3))
            a += (float(np.sum(w * ttft[m])), float(np.sum(w * e2e[m])), float(np.sum(w)))
    return {k: (v[0] / v[2], v[1] / v[2]) for k, v in acc.items() if v[2] > 0}


def _rows(runs, means: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The arrays of the loss: per TTFT row its predicted and measured mean (s); per ITL
    row (where ``fit_on`` has it) the predicted and measured mean ITL (s)."""
    tp, tm, ip, im = [], [], [], []
    for (r, g), (t, e) in sorted(means.items()):
        run = runs[r]
        m = run.groups[g]
        if t > 0 and m.ttft_mean_s > 0:
            tp.append(t)
            tm.append(m.ttft_mean_s)
        if "itl" in run.fit_on and m.itl_mean_s > 0:
            out1 = max(m.output_mean - 1.0, 1.0)
            if e > t:
                ip.append((e - t) / out1)
                im.append(m.itl_mean_s)
    return np.array(tp), np.array(tm), np.array(ip), np.array(im)


def cauchy_nll(r) -> float:
    """The negative log likelihood of log ratios ``r`` under a Cauchy law of unknown scale,
    that scale profiled out (up to a constant): ``min_s Σ log(1 + (r/s)²) + n·log s``."""
    from scipy.optimize import minimize_scalar

    r = np.asarray(r, float)
    if not len(r):
        return 0.0

    def f(ls):
        return float(np.sum(np.log1p((r / math.exp(ls)) ** 2)) + len(r) * ls)

    best = minimize_scalar(f, bounds=(math.log(MIN_SCALE), math.log(3.0)), method="bounded",
                           options={"xatol": 1e-4})
    return float(best.fun)


def shifted_loss(ttft_pred, ttft_meas, itl_pred, itl_meas, lower_s: float
                 ) -> tuple[float, float]:
    """The least loss over a common TTFT shift ``lower_s ≤ Δ ≤ 0`` (s), and that shift:
    ``(loss, Δ)``. The loss is :func:`cauchy_nll` of the TTFT rows plus that of the ITL
    rows, each at its own scale (a group's TTFT scatters far more than its ITL). The work
    only adds to a request's latency, so what the rest of the front end is read as can only
    fall with it; the ITL rows' loss does not move with Δ."""
    from scipy.optimize import minimize_scalar

    tp, tm = np.asarray(ttft_pred, float), np.asarray(ttft_meas, float)
    base = cauchy_nll(np.log(np.asarray(itl_pred, float) / np.asarray(itl_meas, float))) \
        if len(itl_pred) else 0.0
    if not len(tp):
        return base, 0.0
    lo = min(0.0, max(lower_s, -float(tp.min()) * 0.999))

    def f(d):
        return cauchy_nll(np.log((tp + d) / tm))

    if lo >= 0.0:
        return base + f(0.0), 0.0
    best = minimize_scalar(f, bounds=(lo, 0.0), method="bounded", options={"xatol": 1e-5})
    d = min((float(best.x), lo, 0.0), key=f)
    return base + f(d), d


def _scatter(tp, tm, d) -> float:
    r = np.log((np.asarray(tp) + d) / np.asarray(tm))
    return float(1.4826 * np.median(np.abs(r))) if len(r) else math.nan


def fit_api_server(runs: Sequence, kernels: dict, *, admission_s: float,
                   token_grid_s: Sequence[float] = TOKEN_GRID_S,
                   request_grid_s: Sequence[float] = REQUEST_GRID_S, sample: int = 300,
                   log: Callable[[str], None] | None = None) -> ApiServerFit:
    """Fit the API server's work (module docstring) on the fit ``runs`` of one deployment
    class. ``kernels``: run label → the kernel at the serving fit's constants;
    ``admission_s``: its fixed front-end delay (``host_admission_per_request``, s), which
    bounds the work per request and which the shift ``Δ`` may lower to 0 at most."""
    say = log or (lambda m: None)
    t0 = time.perf_counter()
    # a run on the engine's clock starts after the API server: its queue is not in it
    runs = [r for r in runs if r.clock == "client"]
    if not runs:
        raise ValueError("fit_api_server needs a run measured on the client's clock")
    segs = [s for r in runs for s in segments_of(r, sample=sample)]
    groups = sum(1 for r in runs for g in r.groups if g.ttft_mean_s > 0)
    if groups < MIN_GROUPS:
        why = (f"{groups} group{'s' if groups != 1 else ''} with a TTFT, fewer than "
               f"{MIN_GROUPS}: too few to fit the work, the shift and the scale")
        say(f"API server: not fitted: {why}")
        return ApiServerFit(0.0, 0.0, 0.0, False, (math.nan, math.nan), {}, [], math.nan,
                            0, time.perf_counter() - t0, runs, why)
    rows: list = []
    done: dict = {}
    count = [0]

    def evaluate(w_req: float, w_tok: float):
        key = (round(w_req, 9), round(w_tok, 12))
        if w_req > admission_s:
            return None
        if key in done:
            return done[key]
        results = []
        for seg in segs:
            k = kernels[seg.run.label]
            k = k.with_params(k.params.replace(host_api_server_per_request=float(w_req),
                                               host_api_server_per_token=float(w_tok)))
            results.append(replay_segment(seg, k))
            count[0] += 1
        tp, tm, ip, im = _rows(runs, group_means(segs, results))
        # the fixed delay may fall to the work per request, never below
        loss, d = shifted_loss(tp, tm, ip, im, lower_s=max(w_req, 1e-6) - admission_s)
        row = (float(w_req), float(w_tok), d, loss, _scatter(tp, tm, d))
        done[key] = row
        rows.append(row)
        say(f"API server {w_req * 1e3:g} ms/request, {w_tok * 1e6:g} µs/token: "
            f"loss {loss:.2f} (shift {d * 1e3:+.2f} ms)")
        return row

    def line(points) -> None:
        """Along one axis, upwards, until the loss has risen twice past its least."""
        least, rises = math.inf, 0
        for w_req, w_tok in points:
            row = evaluate(w_req, w_tok)
            if row is None:
                continue
            if row[3] < least:
                least, rises = row[3], 0
            else:
                rises += 1
                if rises >= 2:
                    return

    def best():
        return min(rows, key=lambda r: r[3])

    tokens, requests = sorted(token_grid_s), sorted(request_grid_s)
    line([(requests[0], w) for w in tokens])
    if not rows:
        raise ValueError("no grid point fits under the front end's delay of "
                         f"{admission_s * 1e3:g} ms")
    line([(w, best()[1]) for w in requests])
    b = best()                     # the token axis again next to it, at its request time
    i = tokens.index(b[1])
    for j in (i - 1, i + 1):
        if 0 <= j < len(tokens):
            evaluate(b[0], tokens[j])
    b = best()                     # then halfway to its neighbours on each axis, once
    for axis, grid in ((1, tokens), (0, requests)):
        i = grid.index(b[axis])
        for j in (i - 1, i + 1):
            if 0 <= j < len(grid):
                mid = 0.5 * (grid[i] + grid[j])
                evaluate(*((b[0], mid) if axis == 1 else (mid, b[1])))
    replays = count[0]
    from scipy.stats import chi2

    best = best()
    zero = next((r for r in rows if r[0] == 0.0 and r[1] == 0.0), None)
    sigma = best[4]
    crit = float(chi2.ppf(START_TEST_LEVEL, 2))
    if zero is None:
        kept, stat = True, math.inf
    else:
        stat = 2.0 * (zero[3] - best[3])
        kept = bool(stat > crit)
    within = best[3] + float(chi2.ppf(0.95, 1)) / 2.0
    ci = {}
    if kept:
        for i, name in ((0, "host_api_server_per_request"), (1, "host_api_server_per_token")):
            # the values inside, bracketed by the nearest evaluated ones outside (the
            # profile crosses its bound somewhere between them)
            tried = sorted({r[i] for r in rows})
            inside = [v for v in tried if min(r[3] for r in rows if r[i] == v) <= within]
            lo = max([v for v in tried if v < inside[0]], default=inside[0])
            hi = min([v for v in tried if v > inside[-1]], default=inside[-1])
            ci[name] = (lo, hi)
    fit = ApiServerFit(best[0] if kept else 0.0, best[1] if kept else 0.0,
                       best[2] if kept else (zero[2] if zero else 0.0), kept, (stat, crit), ci,
                       [r[:4] for r in rows], sigma, replays, time.perf_counter() - t0,
                       runs)
    say(f"API server: {'kept' if kept else 'not kept'}: {fit.per_request_s * 1e3:g} ms per "
        f"request, {fit.per_token_s * 1e6:g} µs per token (test {stat:.1f} against "
        f"{crit:.1f}); {replays} replays, {fit.wall_s:.0f} s")
    return fit


def refit_with_api_server(fits: list, kernels: dict, names_for: Callable, *, sample: int,
                          log: Callable[[str], None] | None = None,
                          **options) -> tuple[list, list]:
    """The API server's work of every serving fit (:class:`~jkernel.calibration.fit.serving.
    ServingFit`) that took a constant and has runs on the client's clock
    (:func:`fit_api_server`, at the class's fitted constants); where it is kept, the class's
    serving fit is run again with the work in its kernels, from the constants it took (its
    fixed point holds the new waits, so the front end is read again without them).
    ``kernels``: run label → kernel, updated with the work kept; ``names_for(cls,
    fit_runs)``: the names the class's fit moves (as given to ``fit_classes``);
    ``options``: passed on to ``fit_serving``. Returns the fits (refitted where work was
    kept) and, per class fitted here, ``(serving fit, ApiServerFit)``."""
    from .serving import fit_serving

    say = log or (lambda m: None)
    out, api = [], []
    for fit in fits:
        runs = [r for r in fit.runs if r.clock == "client"]
        if not runs or not fit.accepted:
            out.append(fit)
            continue
        taken = {n: float(fit.values[n]) for n in fit.taken()}
        at = {}
        for r in list(fit.runs) + list(fit.held):
            k = kernels[r.label]
            at[r.label] = k.with_params(k.params.replace(**taken))
        adm = float(at[runs[0].label].params["host_admission_per_request"])
        a = fit_api_server(runs, at, admission_s=adm, sample=sample, log=say)
        if a.kept:
            for label in at:
                kernels[label] = kernels[label].with_params(
                    kernels[label].params.replace(**a.values()))
            say(f"{fit.cls}: the serving fit again, with the API server's work")
            fit = fit_serving(fit.runs, names_for(fit.cls, fit.runs), held=fit.held, log=log,
                              kernels=kernels, start=taken, sample=sample, **options)
            say(f"{fit.cls}: {fit.verdict()}")
        out.append(fit)
        api.append((fit, a))
    return out, api
