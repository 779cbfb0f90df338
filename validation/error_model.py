"""Regenerate the error model (``catalog/uncertainty/error-model.yaml``) from held-out
residuals of the shipped constants.

    python -m validation.error_model --residency ../shared/data/residency-vllm \\
        --serving ../shared/data/serving-runs [--baseline BASELINE.csv] \\
        [--out catalog/uncertainty/error-model.yaml] [--residuals RESIDUALS.csv]

What it measures (the statistics are :mod:`jkernel.uncertainty.estimate`'s):

* **step jitter and the fitted deployment's prefill**: the two residency-vllm runs with
  per-chunk timestamps (``jkernel.calibration.regenerate.STEP_RUNS``) rebuilt into step
  traces, their held-out steps (the last 30 % in time of the fitted run, the whole second
  run) priced at the shipped constants, each step's regime from the kernel's bottleneck;
  the step fit is rerun on them (``calibrate_step_runs``) for the correlation of the
  constants it fits together and for the fitted range (the steps it fitted on);
* **systematic error per class**: every compared group of every run the engine
  constants were not fitted on: the residency runs other than the fitted one, the
  serving runs of ``../shared/data/serving-runs`` (as shipped: no serving fit has used
  them; after one, pass ``--only-held-out`` to keep its held-out split only). The group's
  step error is log(measured mean ITL / the price of its operating-point step), less the
  same of the replay at its own operating point (which cancels what the mean-step
  approximation misses, and the queueing a replay near its knee adds): Little's
  law gives the decodes running (N = Σ(E2E − TTFT) / the run's span, or rate × (E2E −
  TTFT) for stage means), with contexts spread evenly over the output, and each
  arrival's uncached prompt runs as one chunk beside them in a share of the steps
  (:func:`operating_point_log_ratio`), per replica of the pool;
* **front end**: measured − predicted mean TTFT of the light-load groups timed by a
  client (the residency runs and each trainval run's first stage; llm-d's held-out loads
  from 20 req/s carry a queue before the engine the front end does not model, and
  llmservingsim times on the engine's clock, so neither is used), from the
  replays as shipped (``--baseline``: the CSV of ``python -m validation.serving_runs
  --csv``; without it the serving runs are replayed here, about 15 minutes).

``--residuals`` writes the group residuals (one row per group, with class, split and the
measured and predicted means), which ``validation/coverage.py`` re-estimates from with
each evaluated deployment left out. A dataset study, not part of the installed library.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["operating_point_step", "operating_point_log_ratio",
           "residency_steps", "residency_groups", "serving_groups", "estimate_from",
           "summary_markdown", "main"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "catalog" / "uncertainty" / "error-model.yaml"
COMMAND = ("python -m validation.error_model --residency ../shared/data/residency-vllm "
           "--serving ../shared/data/serving-runs")


def _replicas(kernel) -> int:
    from jkernel.replay.sim import Pool

    pool = Pool(kernel)
    return pool.dp * len(pool.engines)


def operating_point_step(kernel, *, concurrency: float, rate: float, prompt: float,
                         output: float, uncached: float) -> float:
    """The mean step (seconds) at an operating point: per replica of the pool,
    ``concurrency`` decodes with contexts spread evenly over the answer (``t_dec``), and
    each arrival's ``uncached`` prompt tokens run as one chunk beside them (``t_mix``, a
    GEMM-bound step that a prefill spread over the steps would underprice); with a share
    ``rate · t`` of the steps carrying a chunk, ``t = t_dec / (1 − rate · (t_mix − t_dec))``."""
    reps = _replicas(kernel)
    n = max(1, int(round(concurrency / reps)))
    lam = rate / reps
    ctx = (prompt + (np.arange(n) + 0.5) / n * output).astype(np.int64)
    thr = int(kernel.settings.decode_threshold)

    def price(sched, comp) -> float:
        return float(kernel.step_time(scheduled=np.array(sched, np.int32),
                                      computed=np.array(comp, np.int32),
                                      decode_threshold=thr).expected_s)
    t_dec = price([1] * n, ctx.tolist())
    budget = int(kernel.settings.max_num_batched_tokens) - n
    chunk = int(min(round(uncached), budget))
    t = t_dec
    if chunk > thr and budget > 0:
        t_mix = price([1] * n + [chunk], ctx.tolist() + [int(max(prompt - uncached, 0))])
        busy = lam * (t_mix - t_dec)
        t = t_dec / (1.0 - busy) if busy < 0.9 else t_dec + (t_mix - t_dec) * 9.0
    return float(t)


def operating_point_log_ratio(kernel, *, measured: dict, predicted: dict, rate: float,
                              prompt: float, output: float, uncached: float) -> float:
    """The step error at a group's operating point: ``log(ITL / step)`` of the measured
    side less the same of the replay's own (``measured``/``predicted``: ``concurrency``
    and ``itl_s``). :func:`operating_point_step` is an approximation (the steps' real mix
    of batches is not a mean batch); taking it at both operating points cancels what it
    misses in the same way on both sides, leaving the error of the step price."""
    def one(side: dict) -> float:
        t = operating_point_step(kernel, concurrency=side["concurrency"], rate=rate,
                                 prompt=prompt, output=output, uncached=uncached)
        return math.log(side["itl_s"] / t)
    return one(measured) - one(predicted)


# --------------------------------------------------------------------------------------
# Residency-vllm

def residency_steps(root: str | Path, *, log=None):
    """``(step residuals, fitted range, correlation, calibration)`` of the step-trace
    runs (module docstring)."""
    from jkernel.calibration.data.residency import import_residency
    from jkernel.calibration.fit.traces import price_steps
    from jkernel.calibration.regenerate import STEP_RUNS, calibrate_step_runs
    from jkernel.regimes import classify
    from jkernel.uncertainty.errormodel import Correlation, FittedRange
    from jkernel.uncertainty.estimate import StepResiduals
    from jkernel.uncertainty.extrapolation import deployment_facts

    say = log or (lambda m: None)
    cal = calibrate_step_runs(root, progress=say)
    out = []
    rng = None
    for i, rel in enumerate(STEP_RUNS):
        trace = import_residency(Path(root) / rel).trace
        k = trace.kernel()
        usable = np.array(["idle_before" not in f for f in trace.flags])
        width = max(len(s) for s in trace.scheduled)
        s = np.zeros((len(trace), width), np.int32)
        c = np.zeros_like(s)
        for j, (a, b) in enumerate(zip(trace.scheduled, trace.computed)):
            s[j, :len(a)], c[j, :len(b)] = a, b
        thr = np.asarray(trace.decode_threshold)
        est = k.price_many(scheduled=s, computed=c, decode_threshold=thr)
        pred = price_steps(k, k.params, trace)
        lr = np.log(trace.duration_s / pred)
        regime = classify(s, thr, np.asarray(est.bottleneck))
        if i == 0:
            held = np.asarray(cal.fit.held, bool)
            fit = usable & ~held
            facts = deployment_facts(k)
            rng = FittedRange((facts.hardware,), (facts.model,), (facts.tp,),
                              (facts.engine_version,), int((s[fit] > 0).sum(axis=1).max()),
                              int(s[fit].sum(axis=1).max()), int((s[fit] + c[fit]).max()),
                              f"the steps the step fit used: the first 70 % in time of {rel} "
                              f"({int(fit.sum())} steps)")
            keep = usable & held
            label = f"{rel} (last 30 %)"
        else:
            keep = usable
            label = rel
        out.append(StepResiduals(label, regime[keep], lr[keep], "residency-vllm"))
        say(f"{label}: {int(keep.sum())} held-out steps")
    lap = cal.fit.laplace
    names = [n for n in lap.names if lap.identifiable[n]]
    idx = [lap.names.index(n) for n in names]
    cov = np.asarray(lap.cov_theta)[np.ix_(idx, idx)]
    d = np.sqrt(np.diag(cov))
    cor = Correlation(tuple(names), tuple(tuple(float(x) for x in row)
                                          for row in cov / np.outer(d, d)),
                      "the step-trace fit (python -m jkernel.calibration.regenerate --steps)")
    return out, rng, cor, cal


def residency_groups(root: str | Path, fitted_range, *, log=None) -> list[dict]:
    """One residual row per residency-vllm run (module docstring)."""
    from jkernel.replay import load_requests, replay
    from jkernel.uncertainty.extrapolation import assess

    from .replay import RUNS, SCENARIO, _kernel, measured_summary

    say = log or (lambda m: None)
    k = _kernel(SCENARIO)
    rows = []
    for name, folder in RUNS:
        trace = pd.read_csv(Path(root) / folder / "trace.csv")
        ok = trace[trace["status"].astype(str) == "ok"]
        res = replay(k, load_requests(Path(root) / folder / "trace.csv"))
        meas = measured_summary(trace)
        done = res.requests[res.requests["e2e_s"].notna()]
        ttft = (ok["first_chunk_time_us"] - ok["send_time_us"]).to_numpy() / 1e6
        dec = (ok["last_chunk_time_us"] - ok["first_chunk_time_us"]).to_numpy() / 1e6
        span = (ok["last_chunk_time_us"].max() - ok["send_time_us"].min()) / 1e6
        itl = float(dec.sum() / (ok["output_tokens"] - 1).sum())
        prompt = float(ok["server_input_tokens"].mean())
        pdec = (done["e2e_s"] - done["ttft_s"]).to_numpy()
        pred_itl = float(pdec.sum() / (done["output_tokens"] - 1).sum())
        pspan = float((done["finish_s"].max() - done["arrival_s"].min()))
        lr = operating_point_log_ratio(
            k, measured={"concurrency": float(dec.sum() / span), "itl_s": itl},
            predicted={"concurrency": float(pdec.sum() / pspan), "itl_s": pred_itl},
            rate=len(ok) / span, prompt=prompt, output=float(ok["output_tokens"].mean()),
            uncached=prompt)
        ext = assess(k, fitted_range, steps=res.steps)
        rows.append({"source": "residency-vllm", "run": name, "group": "all",
                     "deployment": SCENARIO, "chip": "h100", "cls": ext.cls,
                     "split": "fitted" if folder.startswith("sweep_rate/agg_2rps") else
                     "held-out",
                     "step_log_ratio": lr, "ttft_residual_s":
                     float(ttft.mean() - done["ttft_s"].mean()),
                     "ttft_mean_measured": float(ttft.mean()),
                     "ttft_mean_predicted": float(done["ttft_s"].mean()),
                     "itl_mean_measured": itl, "itl_mean_predicted": pred_itl,
                     "e2e_mean_measured": meas["e2e_mean"],
                     "e2e_mean_predicted": float(done["e2e_s"].mean()),
                     "flags": "; ".join(f.what for f in ext.flags)})
        say(f"residency {name}: step {lr:+.4f}, TTFT residual "
            f"{rows[-1]['ttft_residual_s'] * 1e3:+.1f} ms, class {ext.cls}")
    return rows


# --------------------------------------------------------------------------------------
# Serving runs

def serving_groups(root: str | Path, baseline: pd.DataFrame, fitted_range, *,
                   log=None) -> list[dict]:
    """One residual row per compared group of the serving runs (module docstring);
    ``baseline``: the table of :func:`validation.serving_runs.baseline`."""
    from jkernel.uncertainty.extrapolation import assess

    from . import serving_runs as S

    say = log or (lambda m: None)
    runs = {(r.source, r.run): r for r in S.discover(root)}
    kernels: dict = {}
    stages = pd.read_csv(Path(root) / "inference-sim-trainval" / "runs.csv")
    rows = []
    for _, b in baseline.iterrows():
        run = runs.get((b["source"], b["run"]))
        if run is None or run.source == "residency":    # residency_groups scores those
            continue
        if run.scenario not in kernels:
            kernels[run.scenario] = S.open_kernel(run.scenario)
        k = kernels[run.scenario]
        ext = assess(k, fitted_range)
        if run.source == "trainval":
            st = stages[(stages["run_id"] == run.run) & (stages["stage_index"] >= 0)]
            stage = int(b["group"].split()[1])
            r = st[st["stage_index"] == stage].iloc[0]
            e2e, ttft = r["e2e_mean_ms"] / 1e3, r["ttft_mean_ms"] / 1e3
            prompt = float(r["system_prompt_len"] + r["question_len"])
            out = float(r["output_len"])
            rate = float(r["stage_rate_rps"])
            itl = (e2e - ttft) / (out - 1)
            conc = rate * (e2e - ttft)
            pdec = float(b["e2e_mean_predicted"] - b["ttft_mean_predicted"])
            pred = {"concurrency": rate * pdec, "itl_s": pdec / (out - 1)}
            uncached = prompt * (1.0 - float(b["cached_fraction"]))
            front = (float(b["ttft_mean_measured"] - b["ttft_mean_predicted"])
                     if stage == 0 else math.nan)
        else:
            df = pd.read_csv(run.requests)
            arr = df["arrival_time_us"].to_numpy() / 1e6
            ttft_s, e2e_s = df["ttft_us"].to_numpy() / 1e6, df["e2e_us"].to_numpy() / 1e6
            span = float((arr + e2e_s).max() - arr.min())
            dec = e2e_s - ttft_s
            out_tok = df["output_tokens"].to_numpy()
            itl = float(dec.sum() / np.maximum(out_tok - 1, 0).sum())
            conc = float(dec.sum() / span)
            rate = len(df) / span
            prompt = float(df["input_tokens"].mean())
            out = float(out_tok.mean())
            uncached = prompt * (1.0 - float(b["cached_fraction"]))
            front = math.nan          # llm-d: a queue before the engine; llmservingsim: engine clock
            pdec = float(b["e2e_mean_predicted"] - b["ttft_mean_predicted"])
            pred = {"concurrency": conc * pdec / float(dec.mean()),
                    "itl_s": float(b["itl_mean_predicted"])}
        lr = operating_point_log_ratio(k, measured={"concurrency": conc, "itl_s": itl},
                                       predicted=pred, rate=rate, prompt=prompt, output=out,
                                       uncached=uncached)
        rows.append({"source": run.source, "run": run.run, "group": b["group"],
                     "deployment": run.scenario, "chip": b["chip"], "cls": ext.cls,
                     "split": b["split"], "step_log_ratio": lr, "ttft_residual_s": front,
                     **{f"{m}_{w}": float(b[f"{m}_{w}"]) for m in
                        ("ttft_mean", "itl_mean", "e2e_mean")
                        for w in ("measured", "predicted")},
                     "flags": "; ".join(f.what for f in ext.flags)})
        say(f"{run.source} {run.run} {b['group']}: step {lr:+.4f}"
            + (f", TTFT residual {front * 1e3:+.1f} ms" if math.isfinite(front) else "")
            + f", class {ext.cls}")
    return rows


# --------------------------------------------------------------------------------------

def estimate_from(steps, table: pd.DataFrame, fitted_range, correlations=(), *,
                  leave_out=None, name: str = "shipped", notes=(), digest: str = "",
                  command: str = COMMAND):
    """The error model of ``steps`` and the residual rows of ``table`` that are not
    ``leave_out`` (a boolean mask) and were not fitted on; ``command`` is recorded as the
    one that made it."""
    from jkernel.uncertainty.estimate import GroupResidual, estimate

    use = table[table["split"] != "fitted"]
    if leave_out is not None:
        use = use[~np.asarray(leave_out, bool)[table["split"] != "fitted"]]
    groups = [GroupResidual(r.source, str(r.run), str(r.group), r.deployment, r.chip, r.cls,
                            float(r.step_log_ratio), float(r.ttft_residual_s))
              for r in use.itertuples()]
    return estimate(steps, groups, name=name, fitted_range=fitted_range,
                    correlations=correlations, command=command, constants_sha256=digest,
                    notes=notes)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}".replace("-", "\u2212")


def summary_markdown(model) -> str:
    """The error model as Markdown: the systematic spread per class and regime (bias and
    sd of the log ratio, in per cent, with what each rests on), the step jitter and the
    front end."""
    from jkernel.regimes import REGIMES
    from jkernel.uncertainty.errormodel import CLASSES

    lines = ["| class | " + " | ".join(r.label for r in REGIMES) + " | rests on |",
             "|---|" + "---:|" * len(REGIMES) + "---|"]
    for c in CLASSES:
        sp = model.systematic[c]
        cells = []
        for s in sp:
            cell = f"{_pct(s.bias)} ± {s.sd * 100:.1f}"
            cells.append(cell + (f" (← {s.borrowed_from})" if s.borrowed_from else ""))
        own = [s for s in sp if not s.borrowed_from]
        rest = (f"{own[0].count} {own[0].unit}" if own else
                f"borrowed from {sp[0].borrowed_from}")
        lines.append(f"| {c.replace('_', ' ')} | " + " | ".join(cells) + f" | {rest} |")
    lines.append("| step jitter (sd) | " + " | ".join(
        f"{s.sd * 100:.1f}" + (f" (← {s.borrowed_from})" if s.borrowed_from else "")
        for s in model.step_jitter) + f" | {model.step_jitter[0].count:,} steps |")
    fe = model.front_end
    lines.append("")
    lines.append(f"Front end (client-side time the model does not price): "
                 f"{fe.bias_s * 1e3:+.1f} ± {fe.sd_s * 1e3:.1f} ms per request, from "
                 f"{fe.count} {fe.unit}. Fitted range: "
                 f"{', '.join(model.fitted_range.hardware)}, "
                 f"{', '.join(model.fitted_range.model)}, tp "
                 f"{', '.join(map(str, model.fitted_range.tp))}, vLLM "
                 f"{', '.join(model.fitted_range.engine_version)}, up to "
                 f"{model.fitted_range.max_requests} requests and "
                 f"{model.fitted_range.max_scheduled_tokens:,} tokens per step.")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.error_model",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--residency", default="../shared/data/residency-vllm")
    p.add_argument("--serving", default="../shared/data/serving-runs")
    p.add_argument("--baseline", default=None, help="the serving runs replayed as shipped "
                   "(CSV of python -m validation.serving_runs --csv); default: replay them")
    p.add_argument("--only-held-out", action="store_true",
                   help="use only the serving runs' held-out split (after a serving fit)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the error-model document")
    p.add_argument("--residuals", default=None, help="also write the group residuals (CSV)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--summary", default=None, metavar="DOCUMENT",
                   help="print an error-model document as the Markdown tables of "
                        "docs/intervals.md instead (reads nothing else)")
    a = p.parse_args(argv)
    if a.summary:
        from jkernel.uncertainty.errormodel import load_error_model

        print(summary_markdown(load_error_model(a.summary)))
        return 0
    for path in (a.residency, a.serving):
        if not Path(path).is_dir():
            print(f"{path}: no such folder", file=sys.stderr)
            return 2
    import jkernel
    from jkernel.uncertainty.errormodel import dump_error_model

    from . import serving_runs as S

    jkernel.enable_x64()
    log = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    steps, rng, cor, _ = residency_steps(a.residency, log=log)
    rows = residency_groups(a.residency, rng, log=log)
    base = pd.read_csv(a.baseline) if a.baseline else S.baseline(a.serving, log=log)
    rows += serving_groups(a.serving, base, rng, log=log)
    table = pd.DataFrame(rows)
    if a.only_held_out:
        table = table[(table["source"] == "residency-vllm") | (table["split"] == "held-out")]
    notes = ["Residuals are log(measured / predicted) at the shipped constants; the "
             "systematic spreads weigh every deployment (the fitted deployment: every run) "
             "the same and are widened by sqrt(1 + 1/n) for n of them.",
             "The front end is every client-side, light-load TTFT residual: time before the "
             "first step and after the first token that the model does not price, plus any "
             "error of the prefill step itself at that load."]
    from jkernel.uncertainty.errormodel import constants_digest

    command = COMMAND + (" --only-held-out" if a.only_held_out else "")
    model = estimate_from(steps, table, rng, [cor], name="shipped", notes=notes,
                          digest=constants_digest(), command=command)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(f"# Generated by `{command}`\n# (validation/error_model.py); do "
                           f"not edit by hand.\n" + dump_error_model(model), encoding="utf-8")
    print(f"wrote {a.out}", file=sys.stderr)
    if a.residuals:
        table.to_csv(a.residuals, index=False)
    print(dump_error_model(model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
