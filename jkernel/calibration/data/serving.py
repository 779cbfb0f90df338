"""Serving runs for the serving fit: a run manifest, the requests to replay and what was
measured of them (per request, or per group of requests).

A user's benchmark runs reach :mod:`jkernel.calibration.fit.serving` through one YAML
**run manifest**; :func:`read_manifest` reads it into :class:`ServingRun` records.

Run-manifest format (YAML, one document)
========================================

::

    kind: ServingRuns                 # required
    version: 1                        # required
    root: ../data/serving-runs        # optional: folder of the data files (relative to the
                                      # manifest); default the manifest's folder
    runs:
    - name: qwen-7b-roleplay          # required, unique within a source
      source: my-benchmarks           # optional label the report groups by (default "runs")
      deployment: bundles/qwen.yaml   # required: a bundle (relative to the manifest) or a
                                      # catalog scenario name
      requests: run1/requests.csv     # required (relative to root): a request table
                                      # (jkernel.replay.load_requests: request_id,
                                      # arrival_s or arrival_time_us, input_tokens,
                                      # output_tokens; a residency-vllm client trace) or a
                                      # benchmark client's result file (.json of vLLM bench
                                      # serve, guidellm, inference-perf; an lmbench .csv with
                                      # ttft_us and e2e_us): jkernel.replay.read_benchmark
      format: requests                # optional: requests | benchmark (default: benchmark
                                      # for .json and for a .csv with ttft_us and e2e_us)
      groups: stage                   # optional: a request column splitting the run into
                                      # compared groups (load stages); default: one group
      measured:                       # optional: the measured group means, when the
      - group: 0                      # requests carry no per-request timings
        requests: 1500                #   requests the group had
        output_tokens: 248            #   mean output tokens (the ITL denominator)
        ttft_mean_ms: 22.0
        e2e_mean_ms: 1497.5
        ttft_p90_ms: 24.2             #   optional
        e2e_p90_ms: 1521.4            #   optional
      clock: client                   # optional: client (default: times from the client's
                                      # send, the API server included) | engine (from the
                                      # engine's arrival: no front end)
      prefix: none                    # optional: none | system | prompt, how prompts repeat
                                      # (columns prompt_id, prefix_group,
                                      # shared_prefix_tokens): see prefix_columns
      conversations: conv.csv         # optional (relative to the manifest; not with
                                      # prefix): the conversation of every request and the
                                      # warm-up sent before the run, for a multi-turn client
                                      # whose prompts resend the conversation so far:
                                      # read_conversations, with_conversations
      fit_on: [ttft, itl]             # optional: what the run's groups contribute to a fit
                                      # ([]: the run is reported, never fitted)
      split: fit                      # optional: fit | held-out (default: held_out_runs)
      env: {VLLM_ALLOW_LONG_MAX_MODEL_LEN: "1"}   # optional: environment to open the bundle

Per-request timings are read, when ``measured`` is absent, from the request table's columns
``ttft_s`` and ``e2e_s``, or ``ttft_us`` and ``e2e_us``, or a residency-vllm client trace's
send / first-chunk / last-chunk times (requests whose ``client_status`` is not ``ok`` are
left out), or from the benchmark result file in its client's own definitions
(:func:`jkernel.replay.metrics.values`: TTFT = first − start, E2E = end − start). Every group
is then summarised as :class:`GroupMeasure`: mean TTFT and E2E, their p90, the mean output
and ITL = (mean E2E − mean TTFT) / (mean output − 1), the definition applied to both sides of
every comparison.

Bad input is refused, never half-read: a manifest key that is unknown, missing or of the
wrong type is a :class:`jkernel.Refusal` naming the file and the key
(``runs[2].measured[0].ttft_mean_ms``); a request table that does not validate is a
:class:`ServingDataError` naming the file, the column and the rows; a measured group with no
request in the table, a group without requests, or two runs of one name in one source are
refused likewise.

The held-out split is by run, per source (:func:`held_out_runs`, the rule of
:mod:`~jkernel.calibration.data.heldout`): a run's groups go with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .heldout import held_out_runs

__all__ = ["MANIFEST_KIND", "CLOCKS", "PREFIXES", "FIT_METRICS", "ServingDataError",
           "GroupMeasure", "ServingRun", "read_manifest", "parse_manifest", "prefix_columns",
           "read_conversations", "with_conversations", "CHAT_CLOSE_TOKENS", "WARM_UP_GAP_S",
           "group_measures", "per_request_timings", "held_out_runs", "environment"]

MANIFEST_KIND = "ServingRuns"
#: Where the measured times start: the client's send (the API server's front end inside)
#: or the engine's arrival (no front end).
CLOCKS = ("client", "engine")
#: How prompts repeat (:func:`prefix_columns`).
PREFIXES = ("none", "system", "prompt")
#: What a group can contribute to a fit: its mean TTFT and its mean ITL.
FIT_METRICS = ("ttft", "itl")


class ServingDataError(ValueError):
    """A serving run's data that cannot be used: names the file, and the row or key."""

    def __init__(self, file: str, reason: str):
        self.file = file
        super().__init__(f"{file}: {reason}")


@dataclass(frozen=True)
class GroupMeasure:
    """The measured statistics of one compared group of a run (seconds).

    ``key`` is the group column's value (−1 when the run is one group); ``requests`` how
    many requests the group had; ``output_mean`` their mean output tokens."""

    key: int
    label: str
    requests: int
    output_mean: float
    ttft_mean_s: float
    e2e_mean_s: float
    ttft_p90_s: float = math.nan
    e2e_p90_s: float = math.nan

    @property
    def itl_mean_s(self) -> float:
        """(mean E2E − mean TTFT) / (mean output − 1)."""
        return (self.e2e_mean_s - self.ttft_mean_s) / max(self.output_mean - 1.0, 1.0)


@dataclass(frozen=True)
class ServingRun:
    """One measured serving run of a manifest.

    Attributes:
      name, source: the run's name and the source it is reported under.
      deployment: the bundle path (absolute) or catalog scenario name.
      requests: the request table to replay (validated, arrival order), with the prefix
        columns of ``prefix`` applied and the group column kept.
      groups: the measured :class:`GroupMeasure` per group, in group order.
      group_column: the request column of the groups (None: one group, key −1).
      clock: ``client`` or ``engine`` (:data:`CLOCKS`).
      split: ``fit`` or ``held-out``.
      fit_on: what the groups contribute to a fit (:data:`FIT_METRICS`).
      clients: how the requests were sent (a benchmark file's closed-loop clients), or None.
      env: environment variables the bundle is opened with.
      measured_ttft_s, measured_e2e_s: per-request timings aligned with ``requests`` (NaN
        for a request not measured), or None when only group means are known.
      file: the manifest; ``index``: the run's position in it; ``sha256``: of the
        requests file.
    """

    name: str
    source: str
    deployment: str
    requests: pd.DataFrame
    groups: tuple[GroupMeasure, ...]
    group_column: str | None = None
    clock: str = "client"
    split: str = "fit"
    fit_on: tuple[str, ...] = FIT_METRICS
    clients: Any = None
    env: tuple[tuple[str, str], ...] = ()
    measured_ttft_s: np.ndarray | None = field(default=None, repr=False)
    measured_e2e_s: np.ndarray | None = field(default=None, repr=False)
    file: str = ""
    index: int = 0
    sha256: str = ""

    @property
    def label(self) -> str:
        return f"{self.source}/{self.name}"

    def group_keys(self) -> np.ndarray:
        """The group key of every request (−1 when the run is one group; −2 for a warm-up
        request, which no group counts)."""
        return _group_keys(self.requests, self.group_column)

    def kernel(self, **kw):
        """The deployment's kernel, opened with the run's environment."""
        import jkernel

        with environment(dict(self.env)):
            return jkernel.open(self.deployment, **kw)


def _group_keys(df: pd.DataFrame, column: str | None) -> np.ndarray:
    """Per request its group key: ``column``'s value, −1 when the run is one group, −2 for a
    warm-up request (:func:`with_conversations`)."""
    warm = (df["warm_up"].to_numpy(bool) if "warm_up" in df.columns
            else np.zeros(len(df), bool))
    keys = np.full(len(df), -2, np.int64)
    keys[~warm] = -1 if column is None else df.loc[~warm, column].to_numpy(np.int64)
    return keys


@contextlib.contextmanager
def environment(values: dict):
    """Set environment variables for the duration of a block (a bundle's start-up flags)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------
# Prefix caching of repeated prompts

def prefix_columns(df: pd.DataFrame, prefix: str, block: int, *, file: str = "") -> pd.DataFrame:
    """A request table with the prefix-cache columns the replay reads for prompts that
    repeat, by rule ``prefix``:

    * ``none``: no shared prefix (the prefix columns are dropped);
    * ``system``: requests of one ``prefix_group`` share their first ``shared_prefix_tokens``;
    * ``prompt``: as ``system``, and requests with the same ``prompt_id`` send the same
      whole prompt (the full blocks of the system prompt are keyed by the group, the rest by
      the prompt; vLLM chains block hashes, so a block after the first prompt-keyed one can
      never match another prompt's).
    """
    if prefix not in PREFIXES:
        raise ValueError(f"prefix must be one of {PREFIXES}, not {prefix!r}")
    df = df.drop(columns=[c for c in ("prefix_length", "block_hashes") if c in df.columns])
    if prefix == "none":
        return df.drop(columns=[c for c in ("prefix_group",) if c in df.columns])
    need = ["prefix_group", "shared_prefix_tokens"] + (["prompt_id"] if prefix == "prompt"
                                                       else [])
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise ServingDataError(file or df.attrs.get("source", "requests"),
                               f"prefix {prefix!r} needs the column(s) {', '.join(missing)}")
    if prefix == "system":
        df["prefix_length"] = df["shared_prefix_tokens"].astype(int)
        return df
    hashes = []
    for group, pid, sys_len, n in zip(df["prefix_group"], df["prompt_id"],
                                      df["shared_prefix_tokens"], df["input_tokens"]):
        shared = int(sys_len) // block
        hashes.append(" ".join(str(1_000_000 + int(group) * 10_000 + j) if j < shared else
                               str(2_000_000_000 + int(pid) * 100_000 + j)
                               for j in range(int(n) // block)))
    df["block_hashes"] = hashes
    return df.drop(columns=["prefix_group"])


# --------------------------------------------------------------------------------------
# Conversations: prompts that continue earlier prompts, and a warm-up before the run

#: Chat-template tokens after a user message that the next turn's prompt does not repeat:
#: the end of the turn and the assistant's header (Llama 3 and Llama 4 templates: the
#: end-of-turn token, the header start and end tokens around "assistant", and "\n\n").
CHAT_CLOSE_TOKENS = 5
#: Seconds from the warm-up's last send to the run's first. LMBench's ShareGPT workload
#: waits for its warm-up to finish and then 10 s more (LMCache/LMBenchmark
#: ``sharegpt/run.sh``); a minute covers the warm-up's slowest request at any load point of
#: the shared runs, and its cached blocks wait for the run either way.
WARM_UP_GAP_S = 60.0
#: The phases of a conversation table.
PHASES = ("warm-up", "run")


def read_conversations(path: str | os.PathLike) -> pd.DataFrame:
    """A conversation table: one row per request of a client that sends conversations, in
    send order, with the columns

    ===================  ==================================================================
    ``phase``            ``warm-up`` (sent before the run and never measured) or ``run``
    ``request_id``       the request's id (``run``: as in the run's request file)
    ``conversation``     whole number ≥ 0: the conversation the prompt belongs to
    ``input_tokens``     ``warm-up`` rows: the prompt's tokens (``run`` rows: blank, the
    ``output_tokens``    run's own counts are used)
    ===================  ==================================================================

    (other columns are kept, unread). A prompt begins with the previous prompt of its
    conversation, as a multi-turn benchmark resends the conversation so far
    (:func:`with_conversations`). Refused with the file, the column and the rows: a missing
    column, an unknown phase, a repeated id, a conversation that is not a whole number
    ≥ 0, a warm-up row without whole token counts ≥ 1."""
    from jkernel.replay.workload import rows_named as rows

    where = str(path)
    try:
        t = pd.read_csv(path, dtype={"request_id": str, "phase": str})
    except (OSError, ValueError) as exc:
        raise ServingDataError(where, f"not a readable CSV table ({exc})") from None
    missing = [c for c in ("phase", "request_id", "conversation", "input_tokens",
                           "output_tokens") if c not in t.columns]
    if missing:
        raise ServingDataError(where, f"missing column {missing[0]!r}; a conversation table "
                               "has phase, request_id, conversation, input_tokens, "
                               "output_tokens")

    bad = ~t["phase"].isin(PHASES).to_numpy()
    if bad.any():
        raise ServingDataError(where, f"column 'phase' at {rows(bad)}: allowed "
                               + ", ".join(PHASES))
    dup = t["request_id"].duplicated(keep=False).to_numpy() | t["request_id"].isna().to_numpy()
    if dup.any():
        raise ServingDataError(where, f"column 'request_id' at {rows(dup)}: every "
                               "request needs an id of its own")
    conv = pd.to_numeric(t["conversation"], errors="coerce").to_numpy(float)
    bad = ~np.isfinite(conv) | (conv < 0) | (conv != np.round(conv))
    if bad.any():
        raise ServingDataError(where, f"column 'conversation' at {rows(bad)}: a whole "
                               "number ≥ 0")
    t["conversation"] = conv.astype(np.int64)
    warm = (t["phase"] == "warm-up").to_numpy()
    for c in ("input_tokens", "output_tokens"):
        v = pd.to_numeric(t[c], errors="coerce").to_numpy(float)
        bad = warm & (~np.isfinite(v) | (v < 1) | (v != np.round(v)))
        if bad.any():
            raise ServingDataError(where, f"column {c!r} at {rows(bad)}: a warm-up "
                                   "request's whole number of tokens ≥ 1")
    t.attrs["source"] = where
    return t


def with_conversations(df: pd.DataFrame, conversations: pd.DataFrame, *,
                       file: str = "") -> pd.DataFrame:
    """The request table ``df`` (validated, arrival order) as a multi-turn client sends it:
    the warm-up requests of ``conversations`` (:func:`read_conversations`) first, at the
    run's mean spacing, the last :data:`WARM_UP_GAP_S` before the run's first request; every
    request in its conversation's prefix group. A prompt begins with the previous prompt of
    its conversation less the chat template's closing tokens (:data:`CHAT_CLOSE_TOKENS`,
    and one more: the last token may merge with the text that follows), so a request's
    ``prefix_length`` is that much of its own prompt: the next turn's prompt shares it,
    block for block, and hits what this one computed (the replay keys a group's blocks by
    position).

    Returns the table with a ``warm_up`` column (True: a warm-up request, never measured),
    arrivals shifted so that the first warm-up request is sent at 0, and measured
    per-request columns (``ttft_us``, ``e2e_us``, …) blank on warm-up rows. A request of
    ``df`` that ``conversations`` does not list is refused, naming the file and the ids."""
    where = file or df.attrs.get("source", "requests")
    run = conversations[conversations["phase"] == "run"]
    ids = df["request_id"].astype(str)
    conv_of = dict(zip(run["request_id"].astype(str), run["conversation"]))
    unknown = [i for i in ids if i not in conv_of]
    if unknown:
        src = conversations.attrs.get("source", "the conversation table")
        raise ServingDataError(where, f"requests {', '.join(unknown[:5])}"
                               + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
                               + f" are not in {src}")
    live = df.copy()
    live["conversation"] = [int(conv_of[i]) for i in ids]
    live["warm_up"] = False
    w = conversations[conversations["phase"] == "warm-up"]
    arrival = live["arrival_s"].to_numpy(float)
    n = len(live)
    spacing = float(arrival[-1] - arrival[0]) / (n - 1) if n > 1 else 1.0
    k = len(w)
    warm = pd.DataFrame({"request_id": w["request_id"].astype(str).to_numpy(),
                         "arrival_s": np.arange(k) * spacing,
                         "input_tokens": w["input_tokens"].astype(np.int64).to_numpy(),
                         "output_tokens": w["output_tokens"].astype(np.int64).to_numpy(),
                         "conversation": w["conversation"].to_numpy(np.int64),
                         "warm_up": True})
    start = (k - 1) * spacing + WARM_UP_GAP_S if k else 0.0
    live["arrival_s"] = arrival - (arrival[0] if n else 0.0) + start
    live = live.drop(columns=["arrival_time_us"], errors="ignore")
    out = pd.concat([warm, live], ignore_index=True)
    out["prefix_group"] = out["conversation"]
    out["prefix_length"] = np.maximum(out["input_tokens"].to_numpy(np.int64)
                                      - CHAT_CLOSE_TOKENS - 1, 0)
    out = out.drop(columns=["block_hashes"], errors="ignore")
    out.attrs.update(df.attrs)
    return out


# --------------------------------------------------------------------------------------
# Measured timings

def per_request_timings(df: pd.DataFrame, *, file: str = "") -> tuple[np.ndarray, np.ndarray] | None:
    """Measured ``(ttft_s, e2e_s)`` per row of a request table (NaN where not measured), or
    None when the table carries none. Columns: ``ttft_s`` + ``e2e_s``; ``ttft_us`` +
    ``e2e_us``; or a client trace's ``measured_send_time_us``,
    ``measured_first_chunk_time_us``, ``measured_last_chunk_time_us`` (rows whose
    ``client_status`` is not ``ok`` are NaN; so are warm-up rows, ``warm_up`` True). A
    negative or non-numeric time is refused, naming the rows."""
    where = file or df.attrs.get("source", "requests")
    if "warm_up" in df.columns and df["warm_up"].astype(bool).any():
        warm = df["warm_up"].astype(bool).to_numpy()     # never measured
        got = per_request_timings(df[~warm].drop(columns="warm_up"), file=where)
        if got is None:
            return None
        out = tuple(np.full(len(df), np.nan) for _ in range(2))
        for o, g in zip(out, got):
            o[~warm] = g
        return out
    if {"ttft_s", "e2e_s"} <= set(df.columns):
        ttft, e2e = (pd.to_numeric(df[c], errors="coerce").to_numpy(float)
                     for c in ("ttft_s", "e2e_s"))
        cols = ("ttft_s", "e2e_s")
    elif {"ttft_us", "e2e_us"} <= set(df.columns):
        ttft, e2e = (pd.to_numeric(df[c], errors="coerce").to_numpy(float) / 1e6
                     for c in ("ttft_us", "e2e_us"))
        cols = ("ttft_us", "e2e_us")
    elif {"measured_send_time_us", "measured_first_chunk_time_us",
          "measured_last_chunk_time_us"} <= set(df.columns):
        send, first, last = (pd.to_numeric(df[f"measured_{c}_time_us"], errors="coerce")
                             .to_numpy(float) for c in ("send", "first_chunk", "last_chunk"))
        ttft, e2e = (first - send) / 1e6, (last - send) / 1e6
        if "client_status" in df.columns:
            bad = df["client_status"].astype(str).to_numpy() != "ok"
            ttft, e2e = np.where(bad, np.nan, ttft), np.where(bad, np.nan, e2e)
            ok = ~bad
        else:
            ok = np.ones(len(df), bool)
        cols = ("measured_first_chunk_time_us", "measured_last_chunk_time_us")
        _check_times(ttft[ok], e2e[ok], cols, where, np.flatnonzero(ok))
        return ttft, e2e
    else:
        return None
    _check_times(ttft, e2e, cols, where, np.arange(len(df)))
    return ttft, e2e


def _check_times(ttft, e2e, cols, where, rows) -> None:
    for name, v in zip(cols, (ttft, e2e)):
        bad = ~np.isfinite(v) | (v < 0)
        if bad.any():
            idx = rows[np.flatnonzero(bad)]
            raise ServingDataError(where, f"column {name!r} has a missing, non-numeric or "
                                   f"negative time at row{'s' if idx.size > 1 else ''} "
                                   + ", ".join(str(int(i)) for i in idx[:5])
                                   + (f" (and {idx.size - 5} more)" if idx.size > 5 else "")
                                   + " (data rows, counted from 0)")
    worse = e2e < ttft
    if worse.any():
        i = int(rows[np.flatnonzero(worse)[0]])
        raise ServingDataError(where, f"row {i}: end-to-end latency below the time to first "
                               "token")


def group_measures(keys: np.ndarray, output_tokens: np.ndarray, ttft_s: np.ndarray,
                   e2e_s: np.ndarray, *, labels: dict | None = None) -> tuple[GroupMeasure, ...]:
    """:class:`GroupMeasure` per group key from per-request timings (NaN = not measured;
    such requests are not counted)."""
    out = []
    ok = np.isfinite(ttft_s) & np.isfinite(e2e_s)
    for key in np.unique(keys):
        m = (keys == key) & ok
        if not m.any():
            continue
        t, e = ttft_s[m], e2e_s[m]
        out.append(GroupMeasure(int(key), (labels or {}).get(int(key), "all" if key == -1
                                                             else f"group {int(key)}"),
                                int(m.sum()), float(np.mean(output_tokens[m])),
                                float(t.mean()), float(e.mean()),
                                float(np.percentile(t, 90)), float(np.percentile(e, 90))))
    return tuple(out)


# --------------------------------------------------------------------------------------
# The manifest

def read_manifest(path: str | os.PathLike, *, root: str | os.PathLike | None = None,
                  sources: Sequence[str] | None = None, runs: Sequence[str] | None = None,
                  block_size: int | None = None) -> list[ServingRun]:
    """The runs of a run manifest (the module docstring), optionally only those of
    ``sources`` or named in ``runs``. ``root`` overrides the manifest's data folder.
    ``block_size``: the KV block size the prefix rule keys on (default: the deployment's)."""
    from ...documents._strict import read_yaml_file

    data, file = read_yaml_file(path, what="serving-run manifest")
    return parse_manifest(data, file=file, root=root, sources=sources, runs=runs,
                          block_size=block_size)


def parse_manifest(data: Any, *, file: str | None = None, root=None, sources=None,
                   runs=None, block_size: int | None = None) -> list[ServingRun]:
    """:func:`read_manifest` of an already parsed document (``file`` names it in errors and
    anchors its relative paths; None: the current folder)."""
    from ...documents._strict import Reader

    r = Reader(data, file)
    r.str("kind", required=True, choices=(MANIFEST_KIND,))
    v = r.int("version", required=True)
    if v != 1:
        raise r.error("version", f"{v} is not supported; allowed: 1")
    here = Path(file).resolve().parent if file else Path.cwd()
    stated_root = r.str("root", None)
    base = Path(root) if root is not None else (here / stated_root if stated_root else here)
    items = r.list("runs", required=True, min_len=1)
    r.done()
    parsed = [_parse_run(Reader(it, file, f"runs[{i}]"), i, file, here) for i, it in
              enumerate(items)]
    seen: dict[tuple[str, str], int] = {}
    for i, p in enumerate(parsed):
        key = (p["source"], p["name"])
        if key in seen:
            raise Reader(items[i], file, f"runs[{i}]").error(
                "name", f"run {p['name']!r} of source {p['source']!r} is also runs[{seen[key]}]")
        seen[key] = i
    # the held-out split by run per source, over every run of the manifest
    names_by_source: dict[str, list[str]] = {}
    for p in parsed:
        names_by_source.setdefault(p["source"], []).append(p["name"])
    held = {s: held_out_runs(s, names) for s, names in names_by_source.items()}
    out = []
    for p in parsed:
        if sources is not None and p["source"] not in sources:
            continue
        if runs is not None and p["name"] not in runs:
            continue
        split = p["split"] or ("held-out" if p["name"] in held[p["source"]] else "fit")
        out.append(_load_run(p, base, split, file, block_size))
    return out


def _parse_run(r, index: int, file, here: Path) -> dict:
    from ...documents._strict import Reader

    p: dict[str, Any] = {"index": index, "reader": r}
    p["name"] = r.str("name", required=True)
    p["source"] = r.str("source", "runs")
    p["deployment"] = r.str("deployment", required=True)
    p["requests"] = r.str("requests", required=True)
    p["format"] = r.str("format", None, choices=("requests", "benchmark"))
    p["groups"] = r.str("groups", None)
    p["clock"] = r.str("clock", "client", choices=CLOCKS)
    p["prefix"] = r.str("prefix", "none", choices=PREFIXES)
    conv = r.str("conversations", None)
    p["conversations"] = None if conv is None else str((here / conv).resolve())
    if conv is not None and p["prefix"] != "none":
        raise r.error("conversations", "a run's prompts repeat by one rule: give "
                      "conversations or prefix, not both")
    fit_on = r.str_list("fit_on", FIT_METRICS)          # [] : reported, never fitted
    for j, m in enumerate(fit_on):
        if m not in FIT_METRICS:
            raise r.error(f"fit_on[{j}]", f"{m!r} is not allowed; allowed: "
                          + ", ".join(FIT_METRICS))
    p["fit_on"] = tuple(fit_on)
    p["split"] = r.str("split", None, choices=("fit", "held-out"))
    env = r.sub("env")
    p["env"] = ()
    if env is not None:
        vals = []
        for k in list(env.data):
            vals.append((str(k), str(env.raw(str(k)))))
        env.done()
        p["env"] = tuple(vals)
    meas = r.list("measured", None, min_len=1)
    p["measured"] = None
    if meas is not None:
        rows = []
        for j, item in enumerate(meas):
            g = Reader(item, file, f"{r.path}.measured[{j}]")
            row = {"group": g.int("group", required=True),
                   "requests": g.int("requests", required=True, minimum=1),
                   "output_tokens": g.num("output_tokens", required=True, minimum=1),
                   "ttft_mean_ms": g.num("ttft_mean_ms", required=True, positive=True),
                   "e2e_mean_ms": g.num("e2e_mean_ms", required=True, positive=True),
                   "ttft_p90_ms": g.num("ttft_p90_ms", math.nan, positive=True),
                   "e2e_p90_ms": g.num("e2e_p90_ms", math.nan, positive=True),
                   "label": g.str("label", None)}
            if row["e2e_mean_ms"] < row["ttft_mean_ms"]:
                raise g.error("e2e_mean_ms", f"{row['e2e_mean_ms']} is below ttft_mean_ms "
                              f"{row['ttft_mean_ms']}")
            g.done()
            rows.append(row)
        keys = [x["group"] for x in rows]
        if len(set(keys)) != len(keys):
            raise r.error("measured", "a group is measured twice")
        p["measured"] = rows
    r.done()
    dep = p["deployment"]
    if dep.endswith((".yaml", ".yml")) or "/" in dep:
        p["deployment"] = str((here / dep).resolve())
    return p


def _load_run(p: dict, base: Path, split: str, file, block_size) -> ServingRun:
    r = p["reader"]
    path = (base / p["requests"]).resolve()
    if not path.is_file():
        raise r.error("requests", f"{path}: no such file")
    fmt = p["format"]
    if fmt is None:
        fmt = "requests"
        if path.suffix.lower() == ".json":
            fmt = "benchmark"
        elif path.suffix.lower() == ".csv":
            head = pd.read_csv(path, nrows=0).columns
            if {"ttft_us", "e2e_us", "arrival_time_us"} <= set(head):
                fmt = "benchmark"
    clients = None
    measured = None
    try:
        if fmt == "benchmark":
            from jkernel.replay import read_benchmark
            from jkernel.replay.metrics import Quantity, values

            bench = read_benchmark(path)
            df = bench.requests.copy()
            measured = (values(Quantity.TTFT, bench.measured),
                        values(Quantity.E2E, bench.measured))
            clients = bench.clients if bench.clients.closed else None
        else:
            from jkernel.replay import load_requests, validate_requests

            raw = _read_table(path)
            if "send_time_us" in raw.columns:          # a client trace: read as such
                df = load_requests(path)
            else:
                # the prefix rule first: a group column without its prefix length is a
                # table the replay refuses until the rule has said what the groups share
                if p["prefix"] != "none" or ("prefix_group" in raw.columns
                                             and "prefix_length" not in raw.columns):
                    raw = prefix_columns(raw, p["prefix"], block_size or _block_size(p),
                                         file=str(path))
                df = validate_requests(raw, source=str(path))
            measured = per_request_timings(df, file=str(path))
    except ServingDataError:
        raise
    except ValueError as exc:        # the replay's and the formats' refusals name the rows
        raise ServingDataError(str(path), str(exc).removeprefix(f"{path}: ")) from exc
    df.attrs["source"] = str(path)
    gcol = p["groups"]
    if gcol is not None and gcol not in df.columns:
        raise r.error("groups", f"{path} has no column {gcol!r}")
    if p["conversations"] is not None:
        if not Path(p["conversations"]).is_file():
            raise r.error("conversations", f"{p['conversations']}: no such file")
        df = with_conversations(df, read_conversations(p["conversations"]), file=str(path))
        k = int(df["warm_up"].sum())
        if measured is not None:     # warm-up requests are never measured
            measured = tuple(np.concatenate([np.full(k, np.nan), m]) for m in measured)
    keys = _group_keys(df, gcol)
    if p["prefix"] != "none" and fmt == "benchmark":
        df = prefix_columns(df, p["prefix"], block_size or _block_size(p), file=str(path))
    if p["measured"] is not None:
        present = set(np.unique(keys).tolist())
        groups = []
        for j, row in enumerate(p["measured"]):
            if row["group"] not in present:
                raise r.error(f"measured[{j}].group", f"{path} has no request of group "
                              f"{row['group']}" + (f" (column {gcol!r})" if gcol else ""))
            groups.append(GroupMeasure(row["group"], row["label"] or (
                "all" if gcol is None else f"{gcol} {row['group']}"), row["requests"],
                row["output_tokens"], row["ttft_mean_ms"] / 1e3, row["e2e_mean_ms"] / 1e3,
                row["ttft_p90_ms"] / 1e3, row["e2e_p90_ms"] / 1e3))
        groups.sort(key=lambda g: g.key)
        ttft = e2e = None
    else:
        if measured is None:
            raise r.error("measured", f"{path} carries no per-request timings (ttft_s and "
                          "e2e_s, ttft_us and e2e_us, or a client trace's chunk times): "
                          "give the group means")
        ttft, e2e = measured
        labels = None if gcol is None else {int(k): f"{gcol} {int(k)}" for k in np.unique(keys)}
        groups = list(group_measures(keys, df["output_tokens"].to_numpy(), ttft, e2e,
                                     labels=labels))
        if not groups:
            raise ServingDataError(str(path), "no request was measured")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return ServingRun(p["name"], p["source"], p["deployment"], df, tuple(groups), gcol,
                      p["clock"], split, p["fit_on"], clients, p["env"], ttft, e2e,
                      file or "", p["index"], digest)


def _read_table(path: Path) -> pd.DataFrame:
    """A request file as it is (CSV or Parquet), before the replay's validation."""
    if path.suffix.lower() in (".parquet", ".pq"):
        return pd.read_parquet(path)
    return pd.read_csv(path)


def _block_size(p: dict) -> int:
    """The KV block size of a run's deployment (the prefix rule keys blocks on it)."""
    import jkernel

    with environment(dict(p["env"])):
        return int(jkernel.open(p["deployment"]).settings.block_size)
