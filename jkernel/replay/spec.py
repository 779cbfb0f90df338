"""Workload specs: a small YAML document that generates a request table (docs/workloads.md).

A spec says when requests arrive (Poisson, constant, gamma, bursts, all at once; one rate
or stages of rates), how long prompts and answers are (fixed, uniform, normal, log-normal,
an empirical histogram), which prompts share a prefix (groups, optionally a pool of fixed
prompts reused in turn), multi-turn sessions whose context grows turn by turn, the clients
that send them (open loop, or N closed-loop clients) and the warm-up and cool-down the
summary leaves out; one ``seed`` makes it reproducible. It is read strictly, like every
jkernel document: an unknown key or a bad value is refused naming the file, the key and
what is allowed (:class:`~jkernel.Refusal`, code R1).

``load_workload(path)`` reads and generates in one call::

    from jkernel.replay import load_workload, replay
    wl = load_workload("spec.yaml")
    res = replay(kernel, wl.requests, clients=wl.clients, window=wl.window)

The arrival rules follow the clients that generate such load: a Poisson process draws
exponential gaps with the first request one gap after the start (vLLM ``bench serve``,
inference-perf); ``rescale: true`` scales a stage's gaps so its last request lands at the
stage's end (vLLM rescales to ``count / rate``; inference-perf's ``constant`` load type
draws ``int(rate × duration)`` exponential gaps and rescales them to the stage's
duration); ``gamma`` is vLLM's ``--burstiness`` (shape; 1 is Poisson). A prompt pool is
inference-perf's ``shared_prefix`` data: groups × prompts per group fixed prompts, group
prefix lengths drawn once per group, question and answer lengths once per prompt, the pool
shuffled once, request *i* sending prompt *i* mod pool size (with multi-turn, it is round
*i* // pool size of that prompt's session).
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..documents._strict import Reader, read_yaml_file
from .clients import Clients, Window
from .workload import validate_requests

__all__ = ["Distribution", "Kind", "Process", "Stage", "Arrival", "Prefix", "Sessions",
           "WorkloadSpec", "GeneratedWorkload", "read_spec", "load_workload"]


class Kind(enum.Enum):
    """A distribution's family."""

    FIXED = "fixed"
    UNIFORM = "uniform"
    NORMAL = "normal"
    LOGNORMAL = "lognormal"
    EXPONENTIAL = "exponential"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Distribution:
    """Lengths (whole tokens, ``integer=True``) or seconds drawn per item.

    ``fixed``: ``value``. ``uniform``: every whole number (or real) in ``[min, max]``.
    ``normal``: ``mean``, ``std``, clipped to ``[min, max]``. ``lognormal``: a log-normal
    with this ``mean`` and ``std`` (moment-matched, as inference-perf does), clipped.
    ``exponential``: ``mean``, clipped. ``histogram``: either ``edges`` (n + 1 increasing
    bin edges) and ``counts`` (n bin counts; a bin is drawn by its count, then a value
    uniformly in ``[lo, hi)``), or ``values`` and ``weights`` (a discrete distribution).
    Whole-number draws are rounded, then clipped.
    """

    kind: Kind
    value: float = 0.0
    mean: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = math.inf
    edges: tuple = ()
    counts: tuple = ()
    values: tuple = ()
    weights: tuple = ()
    integer: bool = True

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k = self.kind
        if k is Kind.FIXED:
            x = np.full(n, float(self.value))
        elif k is Kind.UNIFORM:
            x = (rng.integers(int(self.min), int(self.max) + 1, n).astype(float)
                 if self.integer else rng.uniform(self.min, self.max, n))
        elif k is Kind.NORMAL:
            x = rng.normal(self.mean, self.std, n)
        elif k is Kind.LOGNORMAL:
            if self.std == 0:
                x = np.full(n, float(self.mean))
            else:
                s2 = math.log(1.0 + (self.std / self.mean) ** 2)
                x = rng.lognormal(math.log(self.mean) - s2 / 2.0, math.sqrt(s2), n)
        elif k is Kind.EXPONENTIAL:
            x = rng.exponential(self.mean, n)
        elif self.edges:
            c = np.asarray(self.counts, float)
            b = rng.choice(len(c), n, p=c / c.sum())
            lo, hi = np.asarray(self.edges[:-1], float)[b], np.asarray(self.edges[1:], float)[b]
            if self.integer:                         # whole numbers lo ≤ x < hi
                lo, hi = np.ceil(lo), np.ceil(hi)
                x = lo + np.floor(rng.random(n) * (hi - lo))
            else:
                x = lo + rng.random(n) * (hi - lo)
        else:
            w = np.asarray(self.weights, float)
            x = np.asarray(self.values, float)[rng.choice(len(w), n, p=w / w.sum())]
        x = np.clip(np.round(x) if self.integer else x, self.min, self.max)
        return x.astype(np.int64) if self.integer else x

    @property
    def expected(self) -> float:
        """The mean before clipping (for messages and checks)."""
        k = self.kind
        if k is Kind.FIXED:
            return float(self.value)
        if k is Kind.UNIFORM:
            return (self.min + self.max) / 2.0
        if k in (Kind.NORMAL, Kind.LOGNORMAL, Kind.EXPONENTIAL):
            return float(self.mean)
        if self.edges:
            c = np.asarray(self.counts, float)
            mid = (np.asarray(self.edges[:-1]) + np.asarray(self.edges[1:])) / 2.0
            return float((c * mid).sum() / c.sum())
        w = np.asarray(self.weights, float)
        return float((w * np.asarray(self.values)).sum() / w.sum())


class Process(enum.Enum):
    """An arrival process."""

    POISSON = "poisson"
    CONSTANT = "constant"
    GAMMA = "gamma"
    BURSTS = "bursts"
    IMMEDIATE = "immediate"


@dataclass(frozen=True)
class Stage:
    """One stage of arrivals: ``rate`` per second for ``duration_s`` seconds
    (``int(rate × duration)`` arrivals), or for ``count`` arrivals."""

    rate: float
    duration_s: float | None = None
    count: int | None = None

    @property
    def arrivals(self) -> int:
        return self.count if self.count is not None else int(self.rate * self.duration_s)


@dataclass(frozen=True)
class Arrival:
    """When arrivals come (an arrival is a request, or a session's first turn).

    ``stages``: consecutive stages (one for a single rate); each starts where the previous
    one's duration ended (or at its last arrival when it was given by count).
    ``burstiness``: gamma shape (vLLM ``--burstiness``). ``rescale``: scale each stage's
    gaps so that its last arrival lands at its end. ``bursts``: ``burst_size`` arrivals
    at once every ``burst_interval_s``, ``count`` in all. ``immediate``: ``count``
    arrivals at time 0 (vLLM ``--request-rate inf``; with clients, a pure closed loop).
    """

    process: Process
    stages: tuple[Stage, ...] = ()
    burstiness: float = 1.0
    rescale: bool = False
    burst_size: int = 1
    burst_interval_s: float = 0.0
    count: int = 0

    def times(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Arrival times (s) and each arrival's stage index."""
        p = self.process
        if p is Process.IMMEDIATE:
            return np.zeros(self.count), np.zeros(self.count, np.int64)
        if p is Process.BURSTS:
            i = np.arange(self.count)
            return (i // self.burst_size) * self.burst_interval_s, np.zeros(self.count,
                                                                           np.int64)
        times, stage_of, start = [], [], 0.0
        for k, st in enumerate(self.stages):
            n = st.arrivals
            if p is Process.POISSON:
                gaps = rng.exponential(1.0 / st.rate, n)
            elif p is Process.GAMMA:
                gaps = rng.gamma(self.burstiness, 1.0 / (st.rate * self.burstiness), n)
            else:
                gaps = np.full(n, 1.0 / st.rate)
            span = st.duration_s if st.duration_s is not None else n / st.rate
            if self.rescale and n and gaps.sum() > 0:
                gaps = gaps * (span / gaps.sum())
            t = start + np.cumsum(gaps)
            times.append(t)
            stage_of.append(np.full(n, k, np.int64))
            start = start + st.duration_s if st.duration_s is not None else (
                float(t[-1]) if n else start)
        return np.concatenate(times), np.concatenate(stage_of)


@dataclass(frozen=True)
class Prefix:
    """Shared-prefix groups: ``groups`` groups, each with a prefix of ``tokens`` tokens
    (drawn once per group). With ``prompts_per_group``, a pool of fixed prompts (lengths
    drawn once per prompt) reused in turn, ``order`` ``shuffled`` (once, as inference-perf
    does) or ``grouped``; without, each request is a new prompt of a random group."""

    groups: int
    tokens: Distribution
    prompts_per_group: int = 0
    order: str = "shuffled"


@dataclass(frozen=True)
class Sessions:
    """Multi-turn conversations: ``turns`` per session; a later turn's prompt is the
    conversation so far (every earlier prompt part and answer) and its new question, sent
    ``think_time_s`` after the previous turn finished."""

    turns: Distribution | None
    think_time_s: Distribution


@dataclass(frozen=True)
class WorkloadSpec:
    """A parsed workload spec (see :func:`read_spec` and docs/workloads.md)."""

    seed: int
    arrival: Arrival
    input_tokens: Distribution
    output_tokens: Distribution
    prefix: Prefix | None = None
    sessions: Sessions | None = None
    clients: Clients = field(default_factory=Clients)
    window: Window = field(default_factory=Window)
    source: str | None = None

    def generate(self) -> "GeneratedWorkload":
        return GeneratedWorkload(_generate(self), self.clients, self.window, self)


@dataclass(frozen=True)
class GeneratedWorkload:
    """A spec's requests and how to send them: ``replay(k, wl.requests,
    clients=wl.clients, window=wl.window)``."""

    requests: pd.DataFrame
    clients: Clients
    window: Window
    spec: WorkloadSpec


# -- reading ----------------------------------------------------------------------------

_KIND_KEYS = {
    Kind.FIXED: ("value",), Kind.UNIFORM: ("min", "max"),
    Kind.NORMAL: ("mean", "std", "min", "max"), Kind.LOGNORMAL: ("mean", "std", "min", "max"),
    Kind.EXPONENTIAL: ("mean", "min", "max"),
    Kind.HISTOGRAM: ("edges", "counts", "values", "weights", "min", "max"),
}


def _dist(r: Reader, key: str, *, integer: bool, required: bool = False,
          default: Distribution | None = None, unit: str = "tokens") -> Distribution | None:
    """A distribution: a bare number (fixed) or a mapping with ``distribution:``."""
    unit = f"{unit} (a whole number)" if integer else "seconds"
    low = 1 if integer else 0
    if not r.has(key):
        r.raw(key)
        if required:
            raise r.error(key, f"required key is missing; give a number of {unit} or a "
                               "mapping with distribution: " + ", ".join(k.value for k in Kind))
        return default
    v = r.raw(key)
    if not isinstance(v, dict):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise r.error(key, f"expected a number of {unit} or a mapping with "
                               f"distribution: …, got {type(v).__name__} {v!r}")
        if (integer and v != int(v)) or v < low:
            raise r.error(key, f"{v!r} is out of range; allowed: "
                               f"{'a whole number ≥ 1' if integer else 'seconds ≥ 0'}")
        return Distribution(Kind.FIXED, value=float(v), min=low, integer=integer)
    d = Reader(v, r.file, r.field(key))
    kind = Kind(d.str("distribution", required=True, choices=[k.value for k in Kind]))

    def number(k: str, *, required=False, default=None, minimum=None, positive=False):
        x = d.num(k, default, required=required, minimum=minimum, positive=positive)
        if x is not None and integer and k in ("value", "min", "max") and x != int(x):
            raise d.error(k, f"{x!r} is not a whole number of tokens")
        return x

    lo = number("min", default=None, minimum=low)
    hi = number("max", default=None, minimum=low)
    lo = float(low) if lo is None else lo
    hi = math.inf if hi is None else hi
    kw: dict[str, Any] = {}
    if kind is Kind.FIXED:
        kw["value"] = number("value", required=True, minimum=low)
    elif kind is Kind.UNIFORM:
        if not d.has("min") or not d.has("max"):
            raise d.error("min" if not d.has("min") else "max",
                          "required key is missing; uniform needs min and max")
    elif kind in (Kind.NORMAL, Kind.LOGNORMAL):
        kw["mean"] = number("mean", required=True, minimum=low, positive=kind is Kind.LOGNORMAL)
        kw["std"] = number("std", required=True, minimum=0)
        if not lo <= kw["mean"] <= hi:
            raise d.error("mean", f"{kw['mean']} is outside [min, max] = [{lo}, {hi}]")
    elif kind is Kind.EXPONENTIAL:
        kw["mean"] = number("mean", required=True, positive=True)
    else:
        edges = d.list("edges", None)
        vals = d.list("values", None)
        if (edges is None) == (vals is None):
            raise d.error(None, "a histogram takes edges and counts (bins), or values and "
                                "weights (a discrete distribution), not both or neither")
        pair = ("edges", "counts") if edges is not None else ("values", "weights")
        xs = edges if edges is not None else vals
        ws = d.list(pair[1], None)
        if ws is None:
            raise d.error(pair[1], f"required key is missing; {pair[0]} needs {pair[1]}")
        for name, seq in zip(pair, (xs, ws)):
            for i, x in enumerate(seq):
                if isinstance(x, bool) or not isinstance(x, (int, float)) or \
                        not math.isfinite(x) or x < (low if name == "values" else 0):
                    raise d.error(f"{name}[{i}]", f"{x!r} is out of range; allowed: a "
                                  f"number ≥ {low if name == 'values' else 0}")
        want = len(xs) - 1 if edges is not None else len(xs)
        if len(ws) != want or want < 1:
            raise d.error(pair[1], f"{len(ws)} {pair[1]} for {len(xs)} {pair[0]}; allowed: "
                                   f"{'one count per bin (edges − 1)' if edges is not None else 'one weight per value'}")
        if sum(ws) <= 0:
            raise d.error(pair[1], f"{pair[1]} sum to 0; at least one must be > 0")
        if edges is not None and any(b <= a for a, b in zip(xs, xs[1:])):
            raise d.error("edges", "edges must increase")
        if integer and any(x != int(x) for x in xs):
            raise d.error(pair[0], f"{pair[0]} must be whole numbers of tokens")
        kw.update({pair[0]: tuple(float(x) for x in xs), pair[1]: tuple(float(w) for w in ws)})
    if hi < lo:
        raise d.error("max", f"{hi} is below min {lo}")
    d.done()
    return Distribution(kind, min=lo, max=hi, integer=integer, **kw)


def _stage(r: Reader) -> Stage:
    rate = r.num("rate", required=True, positive=True)
    dur = r.num("duration_s", None, positive=True)
    count = r.int("count", None, minimum=1)
    if (dur is None) == (count is None):
        raise r.error(None, "a stage takes duration_s (int(rate × duration) arrivals) or "
                            "count, exactly one")
    r.done()
    return Stage(rate, dur, count)


def _arrival(r: Reader) -> Arrival:
    proc = Process(r.str("process", required=True, choices=[p.value for p in Process]))
    if proc in (Process.IMMEDIATE, Process.BURSTS):
        count = r.int("count", required=True, minimum=1)
        kw: dict[str, Any] = {"count": count}
        if proc is Process.BURSTS:
            kw["burst_size"] = r.int("size", required=True, minimum=1)
            kw["burst_interval_s"] = r.num("interval_s", required=True, positive=True)
        r.done()
        return Arrival(proc, **kw)
    burst = r.num("burstiness", 1.0, positive=True) if proc is Process.GAMMA else 1.0
    rescale = r.bool("rescale", False)
    stages = r.list("stages", None, min_len=1)
    if stages is not None:
        for k in ("rate", "duration_s", "count"):
            if r.has(k):
                raise r.error(k, "give either stages or rate (with duration_s or count), "
                                 "not both")
        out = tuple(_stage(Reader(s, r.file, f"{r.field('stages')}[{i}]"))
                    for i, s in enumerate(stages))
    else:
        out = (_stage(r),)
    r.done()
    return Arrival(proc, out, burstiness=burst, rescale=rescale)


def _window(r: Reader) -> Window:
    kw: dict[str, Any] = {}
    for end in ("warmup", "cooldown"):
        sub = r.sub(end)
        if sub is None:
            continue
        n = sub.int("requests", None, minimum=0)
        f = sub.num("fraction", None, minimum=0.0)
        s = sub.num("seconds", None, minimum=0.0)
        given = [x for x in (n, f, s) if x is not None]
        if len(given) != 1:
            raise sub.error(None, "give exactly one of requests (a count), fraction (of the "
                                  "requests, below 1) or seconds")
        if f is not None and not f < 1:
            raise sub.error("fraction", f"{f} is out of range; allowed: 0 ≤ fraction < 1")
        sub.done()
        kw.update({k: v for k, v in ((f"{end}_requests", n), (f"{end}_fraction", f),
                                     (f"{end}_s", s)) if v is not None})
    return Window(**kw)


def read_spec(source: str | os.PathLike | dict, *, file: str | None = None) -> WorkloadSpec:
    """Read a workload spec (a YAML file, or its mapping) strictly; refusals (R1) name the
    file, the key and what is allowed."""
    if isinstance(source, dict):
        doc = source
    else:
        doc, file = read_yaml_file(source, "R2", "workload spec")
    r = Reader(doc, file)
    seed = r.int("seed", 0, minimum=0)
    arrival = _arrival(r.sub("arrival", required=True))
    inp = _dist(r, "input_tokens", integer=True, required=True)
    out = _dist(r, "output_tokens", integer=True, required=True)
    prefix = None
    p = r.sub("prefix")
    if p is not None:
        groups = p.int("groups", required=True, minimum=1)
        tokens = _dist(p, "tokens", integer=True, required=True)
        per = p.int("prompts_per_group", 0, minimum=1)
        order = p.str("order", "shuffled", choices=("shuffled", "grouped"))
        if order != "shuffled" and not per:
            raise p.error("order", "order applies to a prompt pool (prompts_per_group)")
        p.done()
        prefix = Prefix(groups, tokens, per, order)
    sessions = None
    s = r.sub("sessions")
    if s is not None:
        pool = prefix is not None and prefix.prompts_per_group > 0
        turns = _dist(s, "turns", integer=True, required=not pool, unit="turns")
        if pool and turns is not None:
            raise s.error("turns", "with a prompt pool, request i is turn i // pool size of "
                                   "the session of prompt i mod pool size (inference-perf's "
                                   "multi-turn); turns is not allowed")
        think = _dist(s, "think_time_s", integer=False,
                      default=Distribution(Kind.FIXED, integer=False))
        s.done()
        sessions = Sessions(turns, think)
    c = r.sub("clients")
    clients = Clients()
    if c is not None:
        n = c.int("concurrency", required=True, minimum=1)
        z = c.num("think_time_s", 0.0, minimum=0.0)
        c.done()
        clients = Clients(n, z)
    window = _window(r)
    r.done()
    return WorkloadSpec(seed, arrival, inp, out, prefix, sessions, clients, window, file)


def load_workload(source: str | os.PathLike | dict) -> GeneratedWorkload:
    """Read a workload spec and generate its requests (see :class:`GeneratedWorkload`)."""
    return read_spec(source).generate()


# -- generating -------------------------------------------------------------------------

def _rngs(seed: int) -> dict[str, np.random.Generator]:
    names = ("arrival", "prefix", "pool", "lengths", "sessions", "think", "groups")
    return {n: np.random.default_rng([seed, i]) for i, n in enumerate(names)}


def _generate(spec: WorkloadSpec) -> pd.DataFrame:
    rng = _rngs(spec.seed)
    at, stage = spec.arrival.times(rng["arrival"])
    n = len(at)
    pre = spec.prefix
    shared = pre.tokens.sample(rng["prefix"], pre.groups) if pre is not None else None
    cols: dict[str, Any] = {}
    if pre is not None and pre.prompts_per_group:
        size = pre.groups * pre.prompts_per_group
        group = np.repeat(np.arange(pre.groups), pre.prompts_per_group)
        question = spec.input_tokens.sample(rng["pool"], size)
        answer = spec.output_tokens.sample(rng["pool"], size)
        order = (rng["pool"].permutation(size) if pre.order == "shuffled"
                 else np.arange(size))
        entry = order[np.arange(n) % size]           # request i sends pool[i mod size]
        g = group[entry]
        cols.update(prefix_group=g, prefix_length=shared[g], prompt_key=entry)
        if spec.sessions is None:
            inp = shared[g] + question[entry]
            out = answer[entry]
        else:                                        # round r of prompt entry's session
            rnd = np.arange(n) // size
            inp = shared[g] + (rnd + 1) * question[entry] + rnd * answer[entry]
            out = answer[entry]
            think = spec.sessions.think_time_s.sample(rng["think"], n)
            cols.update(session_id=entry, think_s=np.where(rnd > 0, think, 0.0))
            del cols["prompt_key"]
        table = pd.DataFrame({"request_id": np.arange(n), "arrival_s": at,
                              "input_tokens": inp, "output_tokens": out, "stage": stage,
                              **cols})
    elif spec.sessions is None:
        inp = spec.input_tokens.sample(rng["lengths"], n)
        out = spec.output_tokens.sample(rng["lengths"], n)
        if pre is not None:
            g = rng["groups"].integers(0, pre.groups, n)
            cols.update(prefix_group=g, prefix_length=shared[g])
            inp = inp + shared[g]
        table = pd.DataFrame({"request_id": np.arange(n), "arrival_s": at,
                              "input_tokens": inp, "output_tokens": out, "stage": stage,
                              **cols})
    else:
        turns = spec.sessions.turns.sample(rng["sessions"], n)
        total = int(turns.sum())
        sess = np.repeat(np.arange(n), turns)
        turn = np.arange(total) - np.repeat(np.cumsum(turns) - turns, turns)
        q = spec.input_tokens.sample(rng["lengths"], total)
        a = spec.output_tokens.sample(rng["lengths"], total)
        # the conversation so far: every earlier question and answer of the session
        grown = np.cumsum(q + a) - (q + a)
        grown -= np.repeat(grown[np.cumsum(turns) - turns], turns)
        base = np.zeros(total, np.int64)
        if pre is not None:
            gs = rng["groups"].integers(0, pre.groups, n)
            cols.update(prefix_group=gs[sess], prefix_length=shared[gs[sess]])
            base = shared[gs[sess]]
        think = spec.sessions.think_time_s.sample(rng["think"], total)
        table = pd.DataFrame({"request_id": np.arange(total), "arrival_s": at[sess],
                              "input_tokens": base + grown + q, "output_tokens": a,
                              "stage": stage[sess], **cols, "session_id": sess,
                              "think_s": np.where(turn > 0, think, 0.0)})
    table.attrs["source"] = spec.source or "workload spec"
    return validate_requests(table, source=spec.source or "workload spec")
