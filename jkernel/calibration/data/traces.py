"""Step traces: the JSON Lines file format of measured whole steps, its reader and writer.

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

A trace reaches a fit as a :class:`StepTrace`: per-step token lists, durations and flags,
with :meth:`StepTrace.stacked` turning the steps into the kernel's batch arrays and
:meth:`StepTrace.held_mask` the one held-out split
(:func:`jkernel.calibration.data.heldout.held_out`). The fits of a trace are in
:mod:`jkernel.calibration.fit.traces`; the importers that write traces from other
measurements in :mod:`~jkernel.calibration.data.importers` and
:mod:`~jkernel.calibration.data.residency`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from jkernel.atomic import write_text

from .heldout import held_out, row_hash

__all__ = ["FORMAT", "VERSION", "TraceError", "StepTrace", "read_trace", "parse_trace",
           "write_trace", "trace_to_lines", "make_trace", "from_steps", "open_deployment"]

FORMAT = "jkernel-step-trace"
VERSION = 1

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
        :func:`~jkernel.calibration.data.heldout.held_out`: ``split="time"`` holds out the
        last ``fraction`` of the steps in time order (``end_s``, else file order; ``seed``
        unused), ``split="hash"`` the steps whose hash of ``(seed, step index)`` is below
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
    write_text(path, "\n".join(trace_to_lines(trace, source=source)) + "\n")


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


def from_steps(deployment, steps: Sequence[Mapping[str, Any]], *, pool=None, source: str = "",
               skipped: Mapping[str, int] | None = None, sha256: str = "") -> StepTrace:
    """A :class:`StepTrace` from rebuilt steps: mappings with ``scheduled``, ``computed``,
    ``prompt`` (token lists), ``duration_s`` and optionally ``decode_threshold``, ``pad``
    and ``flags`` (what the importers and :func:`~jkernel.calibration.data.timestamps.
    reconstruct_steps` produce). No step left is a :class:`TraceError` naming ``skipped``."""
    if not steps:
        raise TraceError(f"no usable step (skipped: {skipped or {}})")
    arr = lambda k: [np.asarray(s[k], np.int64) for s in steps]  # noqa: E731
    return StepTrace(deployment, arr("scheduled"), arr("computed"), arr("prompt"),
                     np.array([s.get("decode_threshold", 1) for s in steps], np.int64),
                     np.array([s.get("pad", 0) for s in steps], np.int64),
                     np.zeros(len(steps), np.int64),
                     np.array([s["duration_s"] for s in steps], np.float64),
                     [tuple(s.get("flags", ())) for s in steps], pool, source,
                     dict(skipped or {}), None, sha256)
