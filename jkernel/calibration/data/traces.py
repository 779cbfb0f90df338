"""Whole-step traces: a file format, a reader and writer, and a gradient fitter.

Step-trace format (JSON Lines, UTF-8)
=====================================

Line 1 is the **header**, a JSON object::

    {"format": "jkernel-step-trace", "version": 1,
     "deployment": "llama-3.1-8b-h100-tp1",        # a catalog scenario name or a bundle path,
                                                    # or the bundle inline: YAML text, or a
                                                    # list [Scenario mapping, Deployment mapping]
     "pool": "colocated",                           # optional: role or index (default 0)
     "source": "vllm 0.31.0 on node-17, 2026-05-02", # optional, free text
     "time_unit": "s"}                               # optional: "s" (default) or "ms"

Every further non-blank line is one **step** (one engine forward pass)::

    {"duration_s": 0.0213,                          # measured wall time of the step (> 0)
     "requests": [[1, 812, 300], [1, 95, 64], [512, 0, 512]],
                                                    # per request: [scheduled, computed,
                                                    # prompt]; prompt is optional
     "decode_threshold": 1,                         # optional (default 1, vLLM's)
     "pad": 0,                                      # optional: DP lockstep pad tokens
     "sm_budget": 0,                                # optional (0 = all SMs)
     "flags": ["idle_before"],                      # optional labels, e.g. from the importers
     "end_s": 12.3456}                              # optional: when the step ended (s since the
                                                    # run's start), for time-ordered splits

``scheduled`` are the tokens the request runs in this step, ``computed`` the tokens already
in its KV cache (jkernel's :class:`~jkernel.Batch`). Instead of ``requests`` a step may give
three parallel lists ``scheduled``, ``computed``, ``prompt``. With ``"time_unit": "ms"`` the
step field is ``duration_ms``. Lines starting with ``#`` are comments.

Validation: a header without ``deployment`` or of another format/version, a step that is
not an object, a token count that is negative / fractional / NaN, or lists of different
lengths raise :class:`TraceError` naming the line. A step whose duration is missing,
NaN, infinite, zero or negative, or which has neither tokens nor pad, is **skipped** and
counted in ``StepTrace.skipped`` (reason → count); a trace left with no step is an error.
A deployment that does not open raises :class:`TraceError` carrying jkernel's refusal.

Fitting (:func:`fit_trace`)
===========================

Chosen parameters of the kernel's :class:`~jkernel.Params` (any names: host overheads,
``kernel_gap``, ``host_serial``, ``hbm_derate``, attention floors…) are fitted against the
measured durations through ``jax.grad`` of the step function's ``expected_s`` (or
``no_overlap_s`` / ``overlap_s`` on request), ``vmap``-ped over the steps (the batch arrays of
all steps stacked, one stack per request-count bucket). Each parameter lives in log space,
``v = exp θ``. The objective is a negative log posterior::

    L(θ) = Σ_steps ½·ρ(r_i)/σ²  +  ½ Σ_params ((θ_j − μ_j)/σ_p)²,   r = log(pred/measured)

with ρ the soft-L1 loss (≈ r² within ±δ), σ the residual scale, and a log-normal prior per
parameter centred on its catalog value (``μ = log v_catalog``, ``σ_p = log 3`` by default).
Optimisation: optax's Adam (``steps``, at σ = 0.05) from the catalog values, then σ is
re-estimated from the residuals' MAD and a few damped Gauss–Newton steps with the soft-L1
loss's IRLS weights finish the fit at that σ. The compiled programs are cached per
(step function, fitted names, target), so refitting the same structure compiles nothing.
A parameter whose catalog value is 0 (``kernel_gap``, ``host_serial`` until a trace fit)
cannot sit in log space at 0: it starts at a typical scale (:data:`ZERO_SCALES`) with the
prior centred there. After the fit, parameters the data cannot identify
(:mod:`calibration.uncertainty`, judged from the data term alone) are reported as such and
**kept at their catalog values**, so an unobserved parameter never drifts.

Steps are split into fit and held-out parts by :func:`calibration.base.held_out` (the last
fraction in time, or a hash of the step's index: :meth:`StepTrace.held_mask`); both errors are
reported, beside those of the catalog values, and a prediction band for any batch follows
from the Laplace covariance (:meth:`TraceFit.band`).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .base import ErrorStats, adam_loop, held_out, row_hash, soft_l1
from .uncertainty import Laplace, gauss_newton, prediction_band

__all__ = ["FORMAT", "VERSION", "TraceError", "StepTrace", "read_trace", "parse_trace",
           "write_trace", "trace_to_lines", "open_deployment", "generate_trace",
           "fit_trace", "TraceFit", "ZERO_SCALES", "TARGETS"]

FORMAT = "jkernel-step-trace"
VERSION = 1
TARGETS = ("expected_s", "no_overlap_s", "overlap_s")

#: Starting scale (SI) of a fitted parameter whose catalog value is 0.
ZERO_SCALES = {"kernel_gap": 1e-6, "host_serial": 100e-6, "host_serial_per_request": 10e-6,
               "host_launch_per_kernel": 2e-6,
               "host_replay_graph_per_step": 10e-6, "host_launch_eager_per_layer": 5e-6,
               "attention_decode_floor": 10e-6, "attention_prefill_floor": 10e-6}
_DEFAULT_ZERO_SCALE = 1e-6


class TraceError(ValueError):
    """A step trace that cannot be read or priced. ``line`` is 1-based (None if not tied to
    one line); ``file`` the path when read from a file."""

    def __init__(self, reason: str, *, file: str | None = None, line: int | None = None):
        self.reason, self.file, self.line = reason, file, line
        where = ""
        if file:
            where += f"{file}"
        if line is not None:
            where += f"{':' if where else 'line '}{line}"
        super().__init__(f"{where}: {reason}" if where else reason)


# --------------------------------------------------------------------------------------
# The trace
# --------------------------------------------------------------------------------------

@dataclass
class StepTrace:
    """A parsed trace. Per-step lists of int arrays (``scheduled``, ``computed``,
    ``prompt``), per-step scalars as numpy arrays, and the header."""

    deployment: Any
    scheduled: list[np.ndarray]
    computed: list[np.ndarray]
    prompt: list[np.ndarray]
    decode_threshold: np.ndarray
    pad: np.ndarray
    sm_budget: np.ndarray
    duration_s: np.ndarray
    flags: list[tuple[str, ...]]
    pool: Any = None
    source: str = ""
    skipped: dict[str, int] = field(default_factory=dict)
    file: str | None = None
    sha256: str = ""
    header: dict = field(default_factory=dict)
    #: optional per-step end time (s since the run's start; the field ``end_s``), for
    #: time-ordered splits
    end_s: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.duration_s)

    def __repr__(self) -> str:
        return (f"StepTrace({len(self)} steps, deployment={_deployment_label(self.deployment)!r}"
                + (f", skipped={self.skipped}" if self.skipped else "") + ")")

    def select(self, mask_or_index) -> "StepTrace":
        idx = np.arange(len(self))[np.asarray(mask_or_index)]
        return StepTrace(self.deployment, [self.scheduled[i] for i in idx],
                         [self.computed[i] for i in idx], [self.prompt[i] for i in idx],
                         self.decode_threshold[idx], self.pad[idx], self.sm_budget[idx],
                         self.duration_s[idx], [self.flags[i] for i in idx], self.pool,
                         self.source, dict(self.skipped), self.file, self.sha256,
                         dict(self.header),
                         None if self.end_s is None else np.asarray(self.end_s)[idx])

    def held_mask(self, fraction: float = 0.2, seed: int = 0, split: str = "hash") -> np.ndarray:
        """Held-out steps, a boolean mask of shape ``(len(self),)``, by
        :func:`calibration.base.held_out`: ``split="time"`` holds out the last ``fraction``
        of the steps in time order (``end_s``, else file order; ``seed`` unused),
        ``split="hash"`` the steps whose hash of ``(seed, step index)`` is below
        ``fraction``."""
        if split == "time":
            t = self.end_s if self.end_s is not None else np.arange(len(self), dtype=float)
            return held_out(fraction, time_s=t)
        if split == "hash":
            return held_out(fraction, key_hash=row_hash(seed, [np.arange(len(self))]))
        raise ValueError(f"split must be 'hash' or 'time', got {split!r}")

    def batches(self):
        """The steps as :class:`jkernel.Batch` objects."""
        from jkernel import Batch
        return [Batch(s, c, p, decode_threshold=int(t), sm_budget=int(b), pad_tokens=int(d))
                for s, c, p, t, b, d in zip(self.scheduled, self.computed, self.prompt,
                                            self.decode_threshold, self.sm_budget, self.pad)]

    def kernel(self, repos=None, **kw):
        """The kernel of the trace's deployment (see :func:`open_deployment`)."""
        return open_deployment(self.deployment, self.pool, repos=repos, file=self.file, **kw)

    def stacked(self, buckets: Sequence[int] | None = None) -> list[tuple[np.ndarray, Any]]:
        """``[(step indices, BatchArrays stacked (n, R))]`` grouped by request-count bucket."""
        from jkernel.batch import DEFAULT_BUCKETS, bucket_for
        from jkernel.step import BatchArrays
        buckets = tuple(buckets or DEFAULT_BUCKETS)
        sizes = np.array([bucket_for(len(s), buckets) for s in self.scheduled])
        out = []
        for R in sorted(set(sizes.tolist())):
            idx = np.nonzero(sizes == R)[0]
            n = len(idx)
            S = np.zeros((n, R), np.int32)
            C = np.zeros((n, R), np.int32)
            P = np.zeros((n, R), np.int32)
            M = np.zeros((n, R), bool)
            for j, i in enumerate(idx):
                k = len(self.scheduled[i])
                S[j, :k], C[j, :k], P[j, :k], M[j, :k] = (self.scheduled[i], self.computed[i],
                                                          self.prompt[i], True)
            arrays = BatchArrays(S, C, M, self.decode_threshold[idx].astype(np.int32),
                                 self.sm_budget[idx].astype(np.int32),
                                 self.pad[idx].astype(np.int32))
            out.append((idx, arrays))
        return out


def _deployment_label(dep) -> str:
    if isinstance(dep, str):
        return dep if "\n" not in dep else "<inline YAML bundle>"
    return "<inline bundle>"


def open_deployment(deployment, pool=None, *, repos=None, file: str | None = None, **kw):
    """Open a trace's deployment: a catalog scenario name, a path, YAML text, or a pair of
    mappings; a disaggregated deployment needs ``pool``. Any failure is a
    :class:`TraceError` that quotes jkernel's refusal."""
    import jkernel
    try:
        if isinstance(deployment, list):
            deployment = tuple(deployment)
        if pool is None:
            return jkernel.open(deployment, repos, **kw)
        return jkernel.open_pool(deployment, pool, repos, **kw)
    except Exception as exc:  # Refusal, OSError, YAML errors…
        raise TraceError(f"the trace's deployment {_deployment_label(deployment)!r} does not "
                         f"open: {type(exc).__name__}: {exc}", file=file) from exc


def _int_list(value, what: str, lineno: int, file) -> np.ndarray:
    if not isinstance(value, list):
        raise TraceError(f"{what} must be a list of integers", file=file, line=lineno)
    out = []
    for x in value:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or \
                (isinstance(x, float) and (not math.isfinite(x) or x != int(x))):
            raise TraceError(f"{what} holds {x!r}: token counts are whole numbers", file=file,
                             line=lineno)
        if x < 0:
            raise TraceError(f"{what} holds {x}: token counts are ≥ 0", file=file, line=lineno)
        out.append(int(x))
    return np.asarray(out, dtype=np.int64)


def _int_field(rec, key, default, lineno, file) -> int:
    v = rec.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or \
            (isinstance(v, float) and (not math.isfinite(v) or v != int(v))):
        raise TraceError(f"{key} must be an integer, got {v!r}", file=file, line=lineno)
    return int(v)


def parse_trace(lines: Iterable[str], *, file: str | None = None) -> StepTrace:
    """Parse the JSON Lines of a trace (see the module docstring)."""
    header = None
    hline = 0
    steps: list[tuple] = []
    skipped: dict[str, int] = {}
    digest = hashlib.sha256()

    def skip(reason):
        skipped[reason] = skipped.get(reason, 0) + 1

    for lineno, raw in enumerate(lines, start=1):
        digest.update(raw.encode() if isinstance(raw, str) else raw)
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"not JSON: {exc.msg}", file=file, line=lineno) from None
        if not isinstance(rec, dict):
            raise TraceError("each line is a JSON object", file=file, line=lineno)
        if header is None:
            header, hline = rec, lineno
            if rec.get("format") != FORMAT:
                raise TraceError(f"the first line must be the header with \"format\": "
                                 f"\"{FORMAT}\", got {rec.get('format')!r}", file=file,
                                 line=lineno)
            if rec.get("version") != VERSION:
                raise TraceError(f"unsupported trace version {rec.get('version')!r} (this "
                                 f"reader knows {VERSION})", file=file, line=lineno)
            if not rec.get("deployment"):
                raise TraceError("the header names no deployment (a catalog scenario, a path "
                                 "or an inline bundle)", file=file, line=lineno)
            unit = rec.get("time_unit", "s")
            if unit not in ("s", "ms"):
                raise TraceError(f"time_unit must be 's' or 'ms', got {unit!r}", file=file,
                                 line=lineno)
            continue
        unit = header.get("time_unit", "s")
        dkey = "duration_s" if unit == "s" else "duration_ms"
        if "requests" in rec:
            reqs = rec["requests"]
            if not isinstance(reqs, list) or not all(isinstance(r, list) and 2 <= len(r) <= 3
                                                     for r in reqs):
                raise TraceError("requests must be a list of [scheduled, computed] or "
                                 "[scheduled, computed, prompt] lists", file=file, line=lineno)
            s = _int_list([r[0] for r in reqs], "scheduled", lineno, file)
            c = _int_list([r[1] for r in reqs], "computed", lineno, file)
            p = _int_list([r[2] if len(r) > 2 else r[0] + r[1] for r in reqs], "prompt",
                          lineno, file)
        else:
            s = _int_list(rec.get("scheduled", []), "scheduled", lineno, file)
            c = _int_list(rec.get("computed", [0] * len(s)), "computed", lineno, file)
            p = _int_list(rec.get("prompt", (s + c).tolist()), "prompt", lineno, file)
            if not (len(s) == len(c) == len(p)):
                raise TraceError(f"scheduled, computed and prompt have lengths {len(s)}, "
                                 f"{len(c)}, {len(p)}", file=file, line=lineno)
        thr = _int_field(rec, "decode_threshold", 1, lineno, file)
        pad = max(_int_field(rec, "pad", 0, lineno, file), 0)
        smb = _int_field(rec, "sm_budget", 0, lineno, file)
        flags = rec.get("flags", [])
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise TraceError("flags must be a list of strings", file=file, line=lineno)
        d = rec.get(dkey)
        if d is None:
            skip("duration_missing")
            continue
        if isinstance(d, bool) or not isinstance(d, (int, float)):
            raise TraceError(f"{dkey} must be a number, got {d!r}", file=file, line=lineno)
        d = float(d) * (1e-3 if unit == "ms" else 1.0)
        if math.isnan(d):
            skip("duration_nan")
            continue
        if math.isinf(d):
            skip("duration_inf")
            continue
        if d <= 0:
            skip("duration_nonpositive")
            continue
        if int(s.sum()) == 0 and pad == 0:
            skip("empty_step")
            continue
        t_end = rec.get("end_s")
        if t_end is not None and (isinstance(t_end, bool) or not isinstance(t_end, (int, float))
                                  or not math.isfinite(t_end)):
            raise TraceError(f"end_s must be a finite number, got {t_end!r}", file=file,
                             line=lineno)
        steps.append((s, c, p, thr, pad, smb, d, tuple(flags), t_end))
    if header is None:
        raise TraceError("the trace is empty (no header line)", file=file)
    if not steps:
        raise TraceError(f"no usable step in the trace (skipped: {skipped or 'none present'})",
                         file=file, line=hline)
    s, c, p, thr, pad, smb, d, flags, t_end = zip(*steps)
    ends = None if any(t is None for t in t_end) else np.asarray(t_end, np.float64)
    return StepTrace(header["deployment"], list(s), list(c), list(p),
                     np.asarray(thr, np.int64), np.asarray(pad, np.int64),
                     np.asarray(smb, np.int64), np.asarray(d, np.float64), list(flags),
                     header.get("pool"), str(header.get("source", "")), skipped, file,
                     digest.hexdigest(), header, ends)


def read_trace(path: str | os.PathLike) -> StepTrace:
    """Read a step trace file (JSON Lines; see the module docstring)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read the trace: {exc}", file=str(p)) from exc
    return parse_trace(io.StringIO(text).readlines(), file=str(p))


def trace_to_lines(trace: StepTrace, *, source: str | None = None) -> list[str]:
    """The JSON Lines of a trace (header first), durations in seconds."""
    header = {"format": FORMAT, "version": VERSION, "deployment": trace.deployment}
    if trace.pool is not None:
        header["pool"] = trace.pool
    src = trace.source if source is None else source
    if src:
        header["source"] = src
    lines = [json.dumps(header, separators=(",", ":"))]
    for i in range(len(trace)):
        rec = {"duration_s": float(trace.duration_s[i]),
               "requests": [[int(a), int(b), int(c)] for a, b, c in
                            zip(trace.scheduled[i], trace.computed[i], trace.prompt[i])]}
        if trace.decode_threshold[i] != 1:
            rec["decode_threshold"] = int(trace.decode_threshold[i])
        if trace.pad[i]:
            rec["pad"] = int(trace.pad[i])
        if trace.sm_budget[i]:
            rec["sm_budget"] = int(trace.sm_budget[i])
        if trace.flags[i]:
            rec["flags"] = list(trace.flags[i])
        if trace.end_s is not None:
            rec["end_s"] = round(float(trace.end_s[i]), 7)
        lines.append(json.dumps(rec, separators=(",", ":")))
    return lines


def write_trace(path: str | os.PathLike, trace: StepTrace, *, source: str | None = None) -> None:
    """Write a trace as JSON Lines."""
    Path(path).write_text("\n".join(trace_to_lines(trace, source=source)) + "\n",
                          encoding="utf-8")


def make_trace(deployment, batches, durations, *, pool=None, source: str = "",
               flags=None) -> StepTrace:
    """A :class:`StepTrace` from :class:`jkernel.Batch` objects and durations (seconds)."""
    d = np.asarray(durations, dtype=np.float64)
    if len(d) != len(batches):
        raise ValueError(f"{len(batches)} batches and {len(d)} durations")
    return StepTrace(deployment, [np.asarray(b.scheduled, np.int64) for b in batches],
                     [np.asarray(b.computed, np.int64) for b in batches],
                     [np.asarray(b.prompt_len, np.int64) for b in batches],
                     np.array([b.decode_threshold for b in batches], np.int64),
                     np.array([b.pad_tokens for b in batches], np.int64),
                     np.array([b.sm_budget for b in batches], np.int64), d,
                     [tuple(f) for f in (flags or [()] * len(batches))], pool, source)


# --------------------------------------------------------------------------------------
# Pricing many steps
# --------------------------------------------------------------------------------------

def _pricer(kernel, target: str):
    """``(params, stacks) -> [log seconds per stack]`` vmapped over the steps."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    many = jax.vmap(kernel.step_fn, in_axes=(None, 0))

    def price(params, stacks):
        return [jnp.log(getattr(many(params, arrays), target)) for arrays in stacks]
    return price


@functools.lru_cache(maxsize=16)
def _price_program(step_fn, target: str):
    """A cached ``jax.jit`` of :func:`_pricer` for one step function and target."""
    many = jax.vmap(step_fn, in_axes=(None, 0))
    return jax.jit(lambda params, stacks: [jnp.log(getattr(many(params, a), target))
                                           for a in stacks])


def generate_trace(kernel, batches, *, params=None, noise: float = 0.03, seed: int = 0,
                   target: str = "expected_s", deployment=None, pool=None,
                   source: str = "generated by calibration.traces.generate_trace") -> StepTrace:
    """A synthetic trace: each batch priced by ``kernel`` (with ``params`` if given) and
    multiplied by ``exp(noise·N(0, 1))`` (numpy's PCG64 with ``seed``)."""
    k = kernel if params is None else kernel.with_params(params)
    dep = deployment if deployment is not None else _kernel_deployment(kernel)
    trace = make_trace(dep, batches, np.ones(len(batches)), pool=pool, source=source)
    price = _price_program(k.step_fn, target)
    t = np.zeros(len(trace))
    stacks = trace.stacked(kernel.buckets)
    logs = price(k.params, [a for _, a in stacks])
    for (idx, _), lg in zip(stacks, logs):
        t[idx] = np.exp(np.asarray(lg))
    rng = np.random.default_rng(seed)
    trace.duration_s = t * np.exp(noise * rng.standard_normal(len(t)))
    return trace


def _kernel_deployment(kernel):
    sc = kernel.inputs.scenario
    return sc.name if sc is not None else None


# --------------------------------------------------------------------------------------
# The fitter
# --------------------------------------------------------------------------------------

class _Programs:
    """The compiled programs of one fit structure (step function, fitted names, target and
    optimiser settings), cached so that refitting a kernel of the same plan (another trace,
    other catalog values, another σ) compiles nothing. Everything that varies is an
    argument: ``data = (arrays, y, w, base params, μ, σ, σ_p)``."""

    def __init__(self, step_fn, names: tuple[str, ...], target: str, steps: int, lr: float,
                 delta: float):
        many = jax.vmap(step_fn, in_axes=(None, 0))

        def log_price(theta, base, arrays):
            p = base.replace(**{n: jnp.exp(theta[i]) for i, n in enumerate(names)})
            return jnp.concatenate([jnp.log(getattr(many(p, a), target)) for a in arrays])

        def residuals(theta, data):
            arrays, y, w, base = data[:4]
            return (log_price(theta, base, arrays) - y) * w

        def objective(theta, data):
            _, _, w, _, mu, sigma, prior_sigma = data
            r = residuals(theta, data)
            r = jnp.where(jnp.isfinite(r), r, 10.0)
            data_term = 0.5 * jnp.sum(soft_l1(r, delta)) / sigma ** 2
            prior = 0.5 * jnp.sum(((theta - mu) / prior_sigma) ** 2)
            return (data_term + prior) / jnp.maximum(jnp.sum(w), 1.0)

        self.residuals = residuals
        self.res_jit = jax.jit(residuals)
        loop = jax.jit(adam_loop(objective, lr))
        self.adam = lambda th0, data: loop(th0, data, int(steps))


@functools.lru_cache(maxsize=8)
def _programs(step_fn, names, target, steps, lr, delta) -> _Programs:
    """The compiled programs of one fit structure (cached: refitting compiles nothing)."""
    return _Programs(step_fn, names, target, steps, lr, delta)


def _polish(residuals, res, objective, theta, data, mu, prior_sigma, sigma, delta, n_rows,
            iters: int = 10) -> np.ndarray:
    """Damped Gauss–Newton (Levenberg–Marquardt) on the same objective after Adam, with the
    soft-L1 loss's IRLS weights ``1/sqrt(1 + (r/δ)²)``: a few exact curvature steps finish
    what a first-order method approaches slowly along correlated directions."""
    from .uncertainty import jacobian_columns
    th = np.asarray(theta, dtype=np.float64)
    best = float(objective(jnp.asarray(th), data))
    lam = 1e-3
    prior = np.eye(len(th)) / prior_sigma ** 2
    for _ in range(iters):
        r = np.asarray(res(jnp.asarray(th), data))
        J = jacobian_columns(residuals, th, (data,))
        ok = np.isfinite(r) & np.all(np.isfinite(J), axis=1)
        r, J = r[ok], J[ok]
        w = 1.0 / np.sqrt(1.0 + (r / delta) ** 2)
        A = (J.T * w) @ J / sigma ** 2 + prior
        g = (J.T * w) @ r / sigma ** 2 + prior @ (th - mu)
        improved = False
        for _ in range(6):
            try:
                step = np.linalg.solve(A + lam * np.diag(np.diag(A)), g)
            except np.linalg.LinAlgError:
                lam *= 10
                continue
            cand = th - step
            val = float(objective(jnp.asarray(cand), data))
            if np.isfinite(val) and val < best:
                th, best, lam, improved = cand, val, max(lam / 10, 1e-9), True
                break
            lam *= 10
        if not improved or np.max(np.abs(step)) < 1e-7:
            break
    return th


@dataclass
class TraceFit:
    """Result of :func:`fit_trace`.

    ``values``: fitted SI values of the chosen names (unidentifiable ones back at their
    catalog values); ``raw``: the optimiser's values before that; ``catalog``: the starting
    catalog values; ``identifiable`` / ``reason`` from the Laplace fit; ``errors``: rows of
    (part, curve, ErrorStats) for the fit and held-out steps; ``held``: which steps of the
    trace given to :func:`fit_trace` were held out (boolean, that trace's length; steps left
    out by ``exclude_flags`` are False), so a report reads the fit's own split.
    """

    names: tuple[str, ...]
    values: dict[str, float]
    raw: dict[str, float]
    catalog: dict[str, float]
    laplace: Laplace
    target: str
    errors: list[tuple[str, str, ErrorStats]]
    steps_fit: int
    steps_held: int
    seconds: float
    sigma: float
    deployment: Any
    trace_file: str | None
    trace_sha256: str
    skipped: dict[str, int]
    notes: list[str]
    kernel: Any = None
    held: np.ndarray | None = None

    @property
    def identifiable(self) -> dict[str, bool]:
        return dict(self.laplace.identifiable)

    def params(self):
        """The kernel's :class:`~jkernel.Params` with the fitted values."""
        return self.kernel.params.replace(**self.values)

    def band(self, batches, *, observation: bool = True):
        """``(low, centre, high)`` seconds for each :class:`jkernel.Batch`: the 95 % band
        from the Laplace covariance of the identifiable fitted parameters, plus the
        residual scatter of one measured step when ``observation`` (a prediction interval)."""
        trace = make_trace(None, list(batches), np.ones(len(batches)))
        stacks = trace.stacked(self.kernel.buckets)
        order = np.concatenate([idx for idx, _ in stacks])
        price = _pricer(self.kernel, self.target)
        base = self.kernel.params.replace(**self.values)
        names = self.laplace.names

        def log_pred(theta, arrays):
            p = base.replace(**{n: jnp.exp(theta[i]) for i, n in enumerate(names)
                                if self.laplace.identifiable[n]})
            return jnp.concatenate(price(p, arrays))
        lo, mid, hi = prediction_band(log_pred, self.laplace, args=([a for _, a in stacks],),
                                      observation=observation)
        out = [np.zeros(len(trace)) for _ in range(3)]
        for arr, vals in zip(out, (lo, mid, hi)):
            arr[order] = vals
        return tuple(out)

    def coefficient_values(self) -> dict[str, float]:
        """SI values of the identifiable fitted parameters (what a coefficient set gets)."""
        return {n: self.values[n] for n in self.names if self.laplace.identifiable[n]}


def fit_trace(trace: StepTrace, fit: Sequence[str], *, kernel=None, repos=None,
              target: str = "expected_s", steps: int = 400, lr: float = 0.05,
              heldout: float = 0.2, seed: int = 0, prior_sigma: float = math.log(3.0),
              delta: float = 0.05, exclude_flags: Sequence[str] = (),
              max_se: float = 0.5, split: str = "hash",
              progress: Callable[[str], None] | None = None) -> TraceFit:
    """Calibrate the parameters named in ``fit`` against a trace (module docstring).

    ``kernel``: the trace's kernel if already open (else opened from the header);
    ``exclude_flags``: steps carrying any of these flags are left out (e.g.
    ``("idle_before",)`` for reconstructed traces); ``split``: ``"hash"`` holds out a
    hash-chosen ``heldout`` fraction of the steps, ``"time"`` the last ``heldout`` fraction
    in time order (``end_s``, else file order).
    """
    say = progress or (lambda m: None)
    import jkernel
    jkernel.enable_x64()
    t0 = time.perf_counter()
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    k = kernel if kernel is not None else trace.kernel(repos)
    names = tuple(dict.fromkeys(fit))
    if not names:
        raise ValueError("name at least one parameter to fit")
    unknown = [n for n in names if n not in k.params]
    if unknown:
        raise ValueError(f"the kernel has no parameter(s) {unknown}; fittable names of this "
                         f"deployment: {', '.join(sorted(k.params))}")
    notes = []
    keep = np.ones(len(trace), bool)
    if exclude_flags:
        keep = np.array([not (set(f) & set(exclude_flags)) for f in trace.flags])
        if not keep.any():
            raise TraceError(f"every step carries one of the flags {list(exclude_flags)}")
        if not keep.all():
            notes.append(f"{int((~keep).sum())} steps flagged {list(exclude_flags)} left out")
        trace = trace.select(keep)
    held = trace.held_mask(heldout, seed, split)
    if held.all() or len(trace) < 5:
        held[:] = False
    held_input = np.zeros(len(keep), bool)
    held_input[np.nonzero(keep)[0]] = held
    n_fit, n_held = int((~held).sum()), int(held.sum())
    say(f"fitting {', '.join(names)} on {n_fit} steps ({n_held} held out), target {target}")
    base = k.params
    catalog = {n: float(base[n]) for n in names}
    mu = np.array([math.log(catalog[n]) if catalog[n] > 0
                   else math.log(ZERO_SCALES.get(n, _DEFAULT_ZERO_SCALE)) for n in names])
    for n in names:
        if catalog[n] <= 0:
            notes.append(f"{n}: catalog value {catalog[n]:g}; started at "
                         f"{ZERO_SCALES.get(n, _DEFAULT_ZERO_SCALE):g} (SI) with the prior "
                         "centred there (kept at the catalog value if unidentified)")
    prog = _programs(k.step_fn, names, target, int(steps), float(lr), float(delta))
    # every step in one set of stacks (fit and held-out together, told apart by a weight),
    # so one compiled program serves the fit, the Jacobian and the error tables
    stacks = trace.stacked(k.buckets)
    order = np.concatenate([idx for idx, _ in stacks])
    y = jnp.asarray(np.log(trace.duration_s[order]))
    w = jnp.asarray((~held[order]).astype(np.float64))
    arrays = [a for _, a in stacks]

    def data_for(sigma):
        return (arrays, y, w, base, jnp.asarray(mu), jnp.asarray(sigma, jnp.float64),
                jnp.asarray(prior_sigma, jnp.float64))

    theta, _ = prog.adam(jnp.asarray(mu), data_for(0.05))
    theta = np.asarray(theta)
    res_jit = prog.res_jit
    r1 = np.asarray(res_jit(jnp.asarray(theta), data_for(0.05)))[np.asarray(w) > 0]
    sigma = float(max(1.4826 * np.median(np.abs(r1 - np.median(r1))), 1e-4))
    say(f"Adam done ({time.perf_counter() - t0:.1f} s); residual scale σ = {sigma:.4f}; "
        "Gauss-Newton polish")
    data = data_for(sigma)

    def objective_np(th, data_):
        # the polish's objective from the residual program (no extra compilation)
        r = np.asarray(res_jit(jnp.asarray(th), data_))
        r = np.where(np.isfinite(r), r, 10.0)
        rho = 2.0 * delta ** 2 * (np.sqrt(1.0 + (r / delta) ** 2) - 1.0)
        return (0.5 * np.sum(rho) / sigma ** 2
                + 0.5 * np.sum(((np.asarray(th) - mu) / prior_sigma) ** 2)) / n_fit
    theta = _polish(prog.residuals, res_jit, objective_np, theta, data, mu, prior_sigma, sigma, delta,
                    n_fit)
    lap = gauss_newton(prog.residuals, theta, names, to_value=jnp.exp, sigma=sigma,
                       args=(data,), prior_precision=np.eye(len(names)) / prior_sigma ** 2,
                       max_se=max_se)
    raw = {n: float(np.exp(theta[i])) for i, n in enumerate(names)}
    values = {n: (raw[n] if lap.identifiable[n] else catalog[n]) for n in names}
    for n in names:
        if not lap.identifiable[n]:
            notes.append(f"{n}: not identifiable from this trace ({lap.reason[n]}); kept at "
                         f"its catalog value {catalog[n]:g}")
    say(f"fit done ({time.perf_counter() - t0:.1f} s)")
    y_np = np.asarray(y)
    hm = np.asarray(w) == 0
    errors = []
    for curve, vals in (("fitted", values), ("catalog", catalog)):
        th = jnp.asarray([math.log(max(vals[n], 1e-300)) for n in names])
        pred_log = np.asarray(res_jit(th, (arrays, y, jnp.ones_like(w), base))) + y_np
        for label, m in (("fit", ~hm), ("held-out", hm)):
            if m.any():
                errors.append((label, curve, ErrorStats.of(np.exp(pred_log[m]),
                                                           np.exp(y_np[m]))))
    errors.sort(key=lambda e: (e[0] != "fit", e[1] != "fitted"))
    return TraceFit(names, values, raw, catalog, lap, target, errors, n_fit, n_held,
                    time.perf_counter() - t0, sigma, trace.deployment, trace.file,
                    trace.sha256, dict(trace.skipped), notes, k, held_input)
