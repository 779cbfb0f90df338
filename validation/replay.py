"""Replay the measured residency-vllm runs and compare with the client's timings.

    python -m validation.replay ../shared/data/residency-vllm [--scenario NAME]
        [--constants shipped|profiles|both] [--markdown]

prints, per run, the measured and predicted mean and p90 of TTFT, ITL and E2E and the error
of each (predicted / measured − 1). ``--constants profiles`` prices with the step constants a
chip has before any step-trace fit (``jkernel.calibration.fit.stepfit.PROFILE_ONLY``)
instead of the shipped ones, and ``both`` runs the two; ``--markdown`` prints the errors as
the Markdown table of ``docs/simulator.md`` (which ``docs/generate.py`` fills from it). The
source (inference-sim/residency-vllm @ 2641b576) is five runs of vLLM 0.23.0 serving
Qwen3-14B on one H100 at 2, 2, 4, 6 and 8 requests/s, 1,024-token prompts and exactly 128
output tokens, streamed. A dataset study, not part of the installed library: run it from the
repository root (``python -m validation.replay`` or ``python validation/replay.py``).

Like is compared with like, from the client's side:

* TTFT = ``first_chunk_time_us − send_time_us``, E2E = ``last_chunk_time_us −
  send_time_us``; the replay's arrival is the send time, its prompt the server's token count.
* ITL as the runs' ``summary.json`` defines it: every gap between consecutive streamed
  chunks, pooled over requests (checked: its mean equals Σ(last − first) / Σ(chunks − 1) of
  ``trace.csv``, 12.21 ms at 2 requests/s). A request streams ``output + 2`` chunks: a role
  chunk that arrives with the first token and a final chunk just after the last (both gaps
  about 10 µs in ``trace.itl.csv``), so the replay's ITL is its token gaps plus two zero gaps
  per request, and its mean is Σ(e2e − ttft) / Σ(output + 1).
* Percentiles of the measured ITL come from ``summary.json`` (three runs have no per-chunk
  file); TTFT and E2E from ``trace.csv``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from jkernel.calibration.data.residency import DEFAULT_DEPLOYMENT
from jkernel.calibration.fit.stepfit import PROFILE_ONLY

__all__ = ["RUNS", "LABELS", "SCENARIO", "measured_summary", "predicted_summary",
           "validate_run", "validate", "format_table", "markdown_table", "main"]

#: (name, folder under the residency-vllm root), in the order of docs/simulator.md's validation table (2, 2 with one tenant, 4, 6, 8 req/s).
RUNS = (
    ("2rps", "sweep_rate/agg_2rps/patched"),
    ("2rps-1T", "sweep_tenants/1T_agg_2rps/patched"),
    ("4rps", "sweep_rate/agg_4rps/patched"),
    ("6rps", "sweep_rate/agg_6rps/patched"),
    ("8rps", "sweep_rate/agg_8rps/patched"),
)

#: How docs/simulator.md names each run.
LABELS = {"2rps": "2 req/s", "2rps-1T": "2 req/s, 1 tenant", "4rps": "4 req/s",
          "6rps": "6 req/s", "8rps": "8 req/s"}

METRICS = ("ttft_mean", "ttft_p90", "itl_mean", "itl_p90", "e2e_mean", "e2e_p90")
#: The catalog scenario of the runs (the residency reader's default deployment).
SCENARIO = DEFAULT_DEPLOYMENT


def measured_summary(trace: pd.DataFrame, summary_json: dict | None = None) -> dict:
    """The client's timings of one run (seconds): ``{metric: value}`` for :data:`METRICS`
    (and p50/p99), from ``trace.csv`` and, for ITL percentiles, ``summary.json``."""
    ok = trace[trace["status"].astype(str) == "ok"] if "status" in trace else trace
    ttft = (ok["first_chunk_time_us"] - ok["send_time_us"]).to_numpy() / 1e6
    e2e = (ok["last_chunk_time_us"] - ok["send_time_us"]).to_numpy() / 1e6
    span = (ok["last_chunk_time_us"] - ok["first_chunk_time_us"]).sum() / 1e6
    span_s = (ok["send_time_us"].max() - ok["send_time_us"].min()) / 1e6
    out = {"requests": int(len(ok)),
           "rate_per_s": float(len(ok) / span_s) if span_s > 0 else float("nan"),
           "itl_mean": float(span / (ok["num_chunks"] - 1).sum())}
    for name, x in (("ttft", ttft), ("e2e", e2e)):
        out[f"{name}_mean"] = float(x.mean())
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(x, q))
    if summary_json is not None:
        itl = summary_json["overall"]["itl_ms"]
        for q in (50, 90, 99):
            out[f"itl_p{q}"] = itl[f"p{q}"] / 1e3
    return out


def predicted_summary(result) -> dict:
    """The same quantities from a :class:`~jkernel.replay.ReplayResult` (seconds)."""
    t = result.requests
    done = t[~t["rejected"] & t["e2e_s"].notna()]
    out = {"requests": int(len(done))}
    for name in ("ttft", "e2e"):
        x = done[f"{name}_s"].to_numpy()
        out[f"{name}_mean"] = float(x.mean())
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = float(np.percentile(x, q))
    out["itl_mean"] = float((done["e2e_s"] - done["ttft_s"]).sum()
                            / (done["output_tokens"] + 1).sum())
    # The replay's token gaps, plus the role chunk's and the final chunk's ~0 gaps.
    pooled = np.concatenate([result.itl_gaps_s, np.zeros(2 * len(done))])
    for q in (50, 90, 99):
        out[f"itl_p{q}"] = float(np.percentile(pooled, q))
    return out


def _kernel(scenario: str, constants: str = "shipped"):
    """The scenario's kernel at its shipped constants, or (``"profiles"``) with the step
    constants a chip has before a step-trace fit (``PROFILE_ONLY``)."""
    import jkernel

    if constants not in ("shipped", "profiles"):
        raise ValueError(f"constants must be 'shipped' or 'profiles', not {constants!r}")
    k = jkernel.open(scenario)
    if constants == "profiles":
        k = k.with_params(k.params.replace(**{n: v for n, v in PROFILE_ONLY.items()
                                              if n in k.params}))
    return k


def validate_run(kernel, folder: Path, *, limit: int | None = None,
                 progress: bool = False) -> dict:
    """Replay one run folder; returns ``{"measured": {...}, "predicted": {...}, "result"}``."""
    from jkernel.replay import load_requests, replay

    trace = pd.read_csv(folder / "trace.csv")
    summary_path = folder / "summary.json"
    sj = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if limit:
        trace = trace.head(limit)
        sj = None
    reqs = load_requests(folder / "trace.csv")
    if limit:
        reqs = reqs.head(limit)
    res = replay(kernel, reqs, progress=progress)
    return {"measured": measured_summary(trace, sj), "predicted": predicted_summary(res),
            "result": res}


def validate(root: str | Path, *, scenario: str = SCENARIO, runs=None,
             limit: int | None = None, progress: bool = False,
             constants: str = "shipped") -> pd.DataFrame:
    """One row per run: measured, predicted and error of each metric in :data:`METRICS`.
    ``constants``: ``"shipped"`` (the catalog's) or ``"profiles"`` (``PROFILE_ONLY``);
    the table's ``attrs`` record it, the scenario, and the kernel's admission overhead of the
    replayed requests' mean prompt (``admission_overhead_s``)."""
    root = Path(root)
    k = _kernel(scenario, constants)
    rows, prompts = [], []
    for name, folder in RUNS:
        if runs and name not in runs:
            continue
        v = validate_run(k, root / folder, limit=limit, progress=progress)
        prompts.append(v["result"].requests["input_tokens"].to_numpy())
        m, p = v["measured"], v["predicted"]
        row = {"run": name, "requests": m["requests"], "rate_per_s": m["rate_per_s"],
               "steps": v["result"].summary["steps"],
               "preemptions": v["result"].summary["preemptions"]}
        for key in METRICS:
            row[f"{key}_measured_s"] = m.get(key, float("nan"))
            row[f"{key}_predicted_s"] = p.get(key, float("nan"))
            row[f"{key}_error"] = row[f"{key}_predicted_s"] / row[f"{key}_measured_s"] - 1
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs["constants"] = constants
    table.attrs["scenario"] = scenario
    if prompts:
        mean_prompt = int(round(float(np.concatenate(prompts).mean())))
        table.attrs["mean_prompt_tokens"] = mean_prompt
        table.attrs["admission_overhead_s"] = float(k.admission_overhead(mean_prompt))
    return table


def format_table(table: pd.DataFrame) -> str:
    """The validation table as text: measured → predicted (error) per metric, ms or s."""
    head = f"{'run':8}{'req':>6}" + "".join(f"{m:>26}" for m in METRICS)
    lines = [head]
    for _, r in table.iterrows():
        cells = []
        for m in METRICS:
            scale, unit = (1.0, "s") if m.startswith("e2e") else (1e3, "")
            cells.append(f"{r[f'{m}_measured_s'] * scale:8.3f}→{r[f'{m}_predicted_s'] * scale:8.3f}"
                         f" ({r[f'{m}_error'] * 100:+6.1f}%)")
        lines.append(f"{r['run']:8}{int(r['requests']):6d}" + "".join(f"{c:>26}" for c in cells))
    lines.append("TTFT and ITL in ms, E2E in s: measured → predicted (predicted/measured − 1)")
    return "\n".join(lines)


_HALVES = {"profiles": "*profile-only step constants*",
           "shipped": "*shipped constants (H100 step-trace fit)*"}


def _pct(x: float) -> str:
    """A ratio as signed per cent with a true minus sign; ``n/a`` where it is not a number
    (a run folder without the ``summary.json`` that holds the measured ITL percentiles)."""
    return "n/a" if not np.isfinite(x) else f"{x * 100:+.1f}".replace("-", "\u2212")


def markdown_table(*tables: pd.DataFrame) -> str:
    """The errors of one or more :func:`validate` tables side by side, as the Markdown of
    docs/simulator.md: per run, the error of the mean of TTFT, ITL and E2E with the p90's in
    brackets (predicted / measured − 1, %), one half per table (its ``attrs["constants"]``),
    then a line giving the range of the mean TTFT miss of the last table in ms."""
    if not tables:
        raise ValueError("markdown_table needs at least one validate() table")
    runs = [list(t["run"]) for t in tables]
    if any(r != runs[0] for r in runs):
        raise ValueError(f"the tables cover different runs: {runs}")
    head = ["run"] + ["TTFT", "ITL", "E2E"] * len(tables)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    halves = [""]
    for t in tables:
        halves += [_HALVES[t.attrs.get("constants", "shipped")], "", ""]
    lines.append("| " + " | ".join(halves) + " |")
    for i, name in enumerate(runs[0]):
        cells = [LABELS.get(name, name)]
        for t in tables:
            r = t.iloc[i]
            for m in ("ttft", "itl", "e2e"):
                cells.append(f"{_pct(r[f'{m}_mean_error'])} % ({_pct(r[f'{m}_p90_error'])})")
        lines.append("| " + " | ".join(cells) + " |")
    last = tables[-1]
    miss_ms = (last["ttft_mean_measured_s"] - last["ttft_mean_predicted_s"]) * 1e3
    lines.append("")
    lines.append(f"With the {_HALVES[last.attrs.get('constants', 'shipped')].strip('*')}, the "
                 f"mean TTFT is {miss_ms.min():.1f} to {miss_ms.max():.1f} ms short per "
                 f"request (measured − predicted) over the {len(last)} runs; the kernel "
                 f"places {last.attrs['admission_overhead_s'] * 1e3:.2f} ms of admission "
                 f"overhead before a {last.attrs['mean_prompt_tokens']:,}-token prompt "
                 f"(the runs' mean) is scheduled.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.replay",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("root", nargs="?", default="../shared/data/residency-vllm",
                   help="the residency-vllm folder (default ../shared/data/residency-vllm)")
    p.add_argument("--scenario", default=SCENARIO)
    p.add_argument("--runs", nargs="*", default=None, help=f"a subset of {[r[0] for r in RUNS]}")
    p.add_argument("--limit", type=int, default=None, help="first N requests of each run")
    p.add_argument("--constants", choices=("shipped", "profiles", "both"), default="shipped",
                   help="price with the catalog's step constants (shipped), the profile-only "
                        "ones (profiles: no step-trace fit), or both, profiles first")
    p.add_argument("--markdown", action="store_true",
                   help="print the errors as the Markdown table of docs/simulator.md")
    p.add_argument("--csv", default=None, help="also write the table as CSV (with --constants "
                                               "both, one file per set: NAME-profiles.csv …)")
    p.add_argument("--progress", action="store_true")
    a = p.parse_args(argv)
    if not Path(a.root).exists():
        print(f"{a.root}: no such folder (the residency-vllm data)", file=sys.stderr)
        return 2
    sets = ("profiles", "shipped") if a.constants == "both" else (a.constants,)
    tables = [validate(a.root, scenario=a.scenario, runs=a.runs, limit=a.limit,
                       progress=a.progress, constants=c) for c in sets]
    if a.markdown:
        print(markdown_table(*tables))
    else:
        for c, t in zip(sets, tables):
            if len(sets) > 1:
                print(f"{c} constants")
            print(format_table(t))
    if a.csv:
        for c, t in zip(sets, tables):
            path = Path(a.csv)
            if len(sets) > 1:
                path = path.with_name(f"{path.stem}-{c}{path.suffix}")
            t.to_csv(path, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
