"""The serving-runs data set replayed as shipped: measured against predicted latencies.

    python -m validation.serving_runs --data /work/shared/data/serving-runs \\
        [--sources trainval llm-d llmservingsim] [--runs RUN ...] [--markdown FILE]
        [--csv FILE] [--save DIR] [--prefix-study] [--progress] [--quiet]

replays every run of ``serving-runs/`` (its README describes the three sources) with the
shipped catalog and constants, through the replay's own request reader
(:func:`jkernel.replay.load_requests`) and scheduler (:func:`jkernel.replay.replay`), on the
deployment bundles of ``validation/scenarios/``, and prints per run and group (a load stage
of a trainval run, a load point of llm-d, a whole llmservingsim run) the measured and
predicted mean TTFT, mean ITL and mean E2E (p90 of TTFT and E2E where measured) with the
signed error predicted / measured − 1, then the medians per source, chip and model family,
for the fitting and the held-out runs (:func:`held_out`). ``validation/BASELINE.md`` is its
``--markdown`` output with the diagnosis.

Like is compared with like, following each source's README:

* **trainval** (inference-sim, vLLM 0.15.1, H100): the measured side is the per-stage means
  and p90s of ``runs.csv``. The requests are regenerated (unseeded arrivals in the original),
  so only stage statistics are compared. ITL on both sides is (mean E2E − mean TTFT) /
  (output length − 1) with the *server's* output length (``output_len``, generated exactly
  under ``ignore_eos``): the file's ``itl_mean_ms`` divides by the client's re-tokenised
  count, which for the Llama-2-7b runs (three training runs and run 67) is 20–30 % short;
  with the server's count the three training runs reproduce ``training_stages.csv``'s
  ``itl_ms_spec_tokens``. Prefix caching: request *i* sends prompt *i* mod 100, so a whole
  prompt repeats every 100 requests; :data:`PREFIX_HIT` says which part of a prompt is taken
  to hit the cache and :func:`prefix_study` is the evidence (``--prefix-study``).
* **llm-d** (vLLM ~0.8.5, Scout FP8, 4 × H100): every load point's file is replayed on its
  own with a cold cache (the prompts are distinct ShareGPT conversations). The server was not
  restarted between load points, so its prefix-cache hits are unknown: E2E and ITL are the
  figures to trust, TTFT is reported but not relied on.
* **llmservingsim** (vLLM 0.19.0, workstation GPUs): TTFT and E2E were taken on the engine's
  clock from its arrival (no HTTP or tokenisation before it; ``queue_us``, the time in the
  waiting queue, is part of TTFT). All four runs are deep in overload, so they test
  queueing, admission and KV pressure more than step time. They are replayed without the
  front end's overheads (:data:`ENGINE_CLOCK`; BASELINE.md's figures kept them, well under
  1 % of these latencies).
* **residency** (vLLM 0.23.0, Qwen3-14B, one H100): the client's send to its first and last
  chunk (``trace.csv``), the replay's arrival the send time; the five runs of
  ``residency-vllm/`` beside ``serving-runs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from jkernel.calibration.data.serving import PREFIXES, prefix_columns

__all__ = ["SOURCES", "METRICS", "PREFIX_HIT", "PREFIXES", "ENGINE_CLOCK", "Run", "discover",
           "held_out", "family", "requests_for", "measured", "predicted", "compare", "replay_run",
           "baseline", "medians", "prefix_study", "markdown", "manifest_document",
           "write_manifest", "main"]

SOURCES = ("trainval", "llm-d", "llmservingsim", "residency")
#: The compared statistics (seconds); ITL has no measured percentile in any source.
METRICS = ("ttft_mean", "ttft_p90", "itl_mean", "e2e_mean", "e2e_p90")
SCENARIOS = Path(__file__).resolve().parent / "scenarios"

#: The part of a trainval prompt taken to be a prefix-cache hit: ``"none"``; ``"system"``
#: (the group's shared system prompt, ``shared_prefix_tokens``); ``"prompt"`` (the whole
#: prompt once it has been seen, as request i repeats prompt i mod 100, with the system
#: prompt shared inside its group before that). Decided from the measured TTFTs by
#: :func:`prefix_study` before any constant was looked at (validation/BASELINE.md, "Prefix
#: caching").
PREFIX_HIT = "prompt"

#: Sources whose times run on the engine's clock from its arrival (no API server before
#: them): replayed without the front end's overheads (admission, output token, completion).
ENGINE_CLOCK = ("llmservingsim",)

#: trainval run id → deployment bundle (validation/scenarios/<stem>.yaml).
TRAINVAL = {
    "17-llama-4-scout-17b-16e-tp2-general-lite-2-1": "llama-4-scout-fp8-h100-tp2-vllm0.15",
    "20-llama-4-scout-17b-16e-tp2-codegen-2": "llama-4-scout-fp8-h100-tp2-vllm0.15",
    "21-llama-4-scout-17b-16e-tp2-roleplay-2": "llama-4-scout-fp8-h100-tp2-vllm0.15",
    "48-llama-4-scout-17b-16e-tp2-reasoning-lite-2-1": "llama-4-scout-fp8-h100-tp2-vllm0.15",
    "20260217-155451-llama-2-7b-tp1-codegen": "llama-2-7b-h100-tp1-vllm0.15",
    "20260217-162547-llama-2-7b-tp1-roleplay": "llama-2-7b-h100-tp1-vllm0.15",
    "20260217-231439-llama-2-7b-tp1-general": "llama-2-7b-h100-tp1-vllm0.15",
    "67-llama-2-7b-hf-tp1-reasoning-lite-1-1": "llama-2-7b-h100-tp1-vllm0.15",
    "60-llama-3-1-70b-tp4-general-lite-4-1": "llama-3.1-70b-h100-tp4-mnbt8192-vllm0.15",
    "61-llama-3-1-70b-tp4-codegen-4-1": "llama-3.1-70b-h100-tp4-mnbt2048-vllm0.15",
    "62-mistral-nemo-12b-tp2-general-lite-2-1": "mistral-nemo-h100-tp2-mnbt1024-vllm0.15",
    "63-mistral-nemo-12b-tp1-codegen-1-1": "mistral-nemo-h100-tp1-vllm0.15",
    "64-qwen2-5-7b-instruct-tp1-roleplay-1-1": "qwen2.5-7b-h100-tp1-mnbt2048-vllm0.15",
    "66-qwen2-5-7b-instruct-tp1-reasoning-lite-1-1": "qwen2.5-7b-h100-tp1-mnbt1024-vllm0.15",
    "65-01-ai-yi-34b-tp2-general-lite-2-1": "yi-34b-h100-tp2-vllm0.15",
}
LLMD = "llama-4-scout-fp8-h100-tp4-vllm0.8.5"
LLMD_FOLDER = "llm-d-lmbench/exp4_scout_fp8_tp4_h100"
#: The conversations behind every llm-d load point (LMBench's ShareGPT workload: 55
#: conversations resent turn by turn, the second turn of each as a warm-up before every
#: load point; workloads/README.md): its prompts are prefix-cache hits up to the previous
#: turn, which the replay must see (validation/BASELINE.md, "the llm-d cache state").
LLMD_CONVERSATIONS = Path(__file__).resolve().parent / "workloads" / "lmbench-sharegpt.csv"
#: llmservingsim run folder → deployment bundle.
LLMSERVINGSIM = {
    "RTXPRO6000_Llama-3.1-8B": "llama-3.1-8b-rtx-pro-6000-tp1-vllm0.19",
    "RTXPRO6000_Qwen3-30B-A3B-Instruct-2507": "qwen3-30b-a3b-rtx-pro-6000-dp2-ep-vllm0.19",
    "RTXPRO6000_Qwen3-32B": "qwen3-32b-rtx-pro-6000-tp2-vllm0.19",
    "RTX4090_Llama-3.1-8B": "llama-3.1-8b-rtx-4090-tp1-vllm0.19",
}
#: Bundles whose stated max_model_len is the checkpoint's, beyond the catalog graph's config
#: (qwen3-30b-a3b's 40,960 against Instruct-2507's 262,144): opened as vLLM was started,
#: with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1.
LONG_MAX_MODEL_LEN = {"qwen3-30b-a3b-rtx-pro-6000-dp2-ep-vllm0.19"}

_FAMILIES = (("llama-4", "llama-4 (MoE)"), ("llama-2", "llama-2"), ("llama-3", "llama-3.1"),
             ("mistral", "mistral"), ("qwen2.5", "qwen2.5"), ("qwen3-30b", "qwen3 (MoE)"),
             ("qwen3", "qwen3"), ("yi", "yi"))


@dataclass(frozen=True)
class Run:
    """One measured run: where its requests are and which bundle replays it.

    ``groups`` names the request column that splits it into compared groups (``stage`` for
    the trainval runs) or is None (the run is one group)."""

    source: str
    run: str
    scenario: str
    requests: Path
    groups: str | None = None

    @property
    def bundle(self) -> Path:
        """The validation bundle, else the catalog scenario of that name (residency)."""
        local = SCENARIOS / f"{self.scenario}.yaml"
        if local.exists():
            return local
        from jkernel.catalog import scenario_path

        return scenario_path(self.scenario)

    def describe(self) -> dict:
        """The bundle's model and chip, and the model family."""
        sc = next(yaml.safe_load_all(self.bundle.read_text()))
        return {"model": sc["model"], "chip": sc["cluster"]["hardware"],
                "family": family(sc["model"]), "engine_version": sc["engine_version"]}


def family(model: str) -> str:
    """The model family a catalog model belongs to (the medians' grouping)."""
    for prefix, name in _FAMILIES:
        if model.startswith(prefix):
            return name
    return model


def held_out(source: str, runs) -> set[str]:
    """The held-out runs of one source: the third (rounded, at least one) whose
    ``sha256("<source>/<run>")`` sorts first. Fixed before any fit, by run, never by request;
    a run's load stages go with it."""
    from jkernel.calibration.data.heldout import held_out_runs

    return held_out_runs(source, runs)


def discover(root: str | Path, sources=SOURCES, runs=None) -> list[Run]:
    """The runs of ``root`` (a serving-runs folder, or an excerpt with the same layout) for
    ``sources``, optionally only those named in ``runs``. A source absent from ``root`` has
    no runs."""
    root = Path(root)
    out: list[Run] = []
    if "trainval" in sources:
        folder = root / "inference-sim-trainval" / "requests"
        for run, scenario in TRAINVAL.items():
            if (folder / f"{run}.csv").exists():
                out.append(Run("trainval", run, scenario, folder / f"{run}.csv", "stage"))
    if "llm-d" in sources:
        folder = root / LLMD_FOLDER
        files = sorted(folder.glob("LMBench_sharegpt_output_*.csv"),
                       key=lambda p: float(p.stem.rsplit("_", 1)[1]))
        out += [Run("llm-d", p.stem.rsplit("_", 1)[1] + " req/s", LLMD, p) for p in files]
    if "llmservingsim" in sources:
        for run, scenario in LLMSERVINGSIM.items():
            path = root / "llmservingsim" / run / "requests.csv"
            if path.exists():
                out.append(Run("llmservingsim", run, scenario, path))
    if "residency" in sources:
        from jkernel.calibration.data.residency import DEFAULT_DEPLOYMENT

        for run, folder in RESIDENCY.items():
            path = root.parent / "residency-vllm" / folder / "trace.csv"
            if path.exists():
                out.append(Run("residency", run, DEFAULT_DEPLOYMENT, path))
    if runs:
        out = [r for r in out if r.run in runs]
    return out


# --------------------------------------------------------------------------------------
# Requests

def requests_for(run: Run, *, prefix: str = PREFIX_HIT, block: int = 16,
                 limit: int | None = None) -> pd.DataFrame:
    """The run's request table as the replay reads it (:func:`jkernel.replay.load_requests`),
    with the trainval prefix-cache columns of hypothesis ``prefix``; the first ``limit``
    requests only when given."""
    from jkernel.replay import load_requests, validate_requests

    if run.source == "residency":                      # a client trace (send times)
        df = load_requests(run.requests)
        return df.head(limit).copy() if limit else df
    df = pd.read_csv(run.requests)
    if run.source == "trainval":      # the prefix rule first: the replay refuses a group
        df = prefix_columns(df, prefix, block,      # column without its prefix length
                            file=str(run.requests))
    df = validate_requests(df, source=str(run.requests))
    if limit:
        df = df.head(limit).copy()
    if run.source == "llm-d":
        from jkernel.calibration.data.serving import read_conversations, with_conversations

        df = validate_requests(with_conversations(df, read_conversations(LLMD_CONVERSATIONS),
                                                  file=str(run.requests)),
                               source=str(run.requests))
    return df


# --------------------------------------------------------------------------------------
# Measured and predicted statistics

def _stats(ttft_s: np.ndarray, e2e_s: np.ndarray, output_tokens: np.ndarray) -> dict:
    """Mean and p90 of TTFT and E2E, and ITL = (mean E2E − mean TTFT) / (mean output − 1)."""
    ttft, e2e = np.asarray(ttft_s, float), np.asarray(e2e_s, float)
    out = float(np.mean(output_tokens))
    return {"requests": int(ttft.size),
            "ttft_mean": float(ttft.mean()), "ttft_p90": float(np.percentile(ttft, 90)),
            "e2e_mean": float(e2e.mean()), "e2e_p90": float(np.percentile(e2e, 90)),
            "itl_mean": float((e2e.mean() - ttft.mean()) / max(out - 1.0, 1.0))}


def measured(run: Run, root: str | Path, requests: pd.DataFrame | None = None) -> pd.DataFrame:
    """The measured statistics of ``run``, one row per group (seconds): ``group`` and the
    :data:`METRICS`. trainval: the stage rows of ``runs.csv``; the others: computed from
    the measured per-request columns of ``requests`` (default: the whole file)."""
    if run.source == "trainval":
        t = pd.read_csv(Path(root) / "inference-sim-trainval" / "runs.csv")
        t = t[(t["run_id"] == run.run) & (t["stage_index"] >= 0)]
        if t.empty:
            raise ValueError(f"{run.run}: no stage rows in runs.csv")
        rows = []
        for _, r in t.sort_values("stage_index").iterrows():
            out = float(r["output_len"])
            rows.append({"group": f"stage {int(r['stage_index'])} ({r['stage_rate_rps']:g} "
                                  "req/s)",
                         "stage": int(r["stage_index"]), "requests": int(r["n_requests"]),
                         "ttft_mean": r["ttft_mean_ms"] / 1e3, "ttft_p90": r["ttft_p90_ms"] / 1e3,
                         "e2e_mean": r["e2e_mean_ms"] / 1e3, "e2e_p90": r["e2e_p90_ms"] / 1e3,
                         "itl_mean": (r["e2e_mean_ms"] - r["ttft_mean_ms"]) / 1e3 / (out - 1)})
        return pd.DataFrame(rows)
    df = requests if requests is not None else requests_for(run)
    from jkernel.calibration.data.serving import per_request_timings

    ttft, e2e = per_request_timings(df, file=str(run.requests))
    ok = np.isfinite(ttft) & np.isfinite(e2e)
    s = _stats(ttft[ok], e2e[ok], df["output_tokens"].to_numpy()[ok])
    return pd.DataFrame([{"group": "all", "stage": -1, **s}])


def predicted(run: Run, table: pd.DataFrame) -> pd.DataFrame:
    """The replay's statistics of ``run`` (its per-request table), grouped as
    :func:`measured` groups the measured side."""
    done = table[~table["rejected"] & table["e2e_s"].notna()]
    if "warm_up" in done.columns:                  # sent before the run, never measured
        done = done[~done["warm_up"].astype(bool)]
    if run.groups is None:
        return pd.DataFrame([{"stage": -1, **_stats(done["ttft_s"], done["e2e_s"],
                                                    done["output_tokens"])}])
    rows = []
    for stage, g in done.groupby(run.groups):
        rows.append({"stage": int(stage), **_stats(g["ttft_s"], g["e2e_s"], g["output_tokens"])})
    return pd.DataFrame(rows)


def compare(meas: pd.DataFrame, pred: pd.DataFrame) -> pd.DataFrame:
    """One row per group: ``<metric>_measured``, ``<metric>_predicted`` and ``<metric>_error``
    (predicted / measured − 1) for each of :data:`METRICS`, joined on ``stage``."""
    m = meas.set_index("stage")
    p = pred.set_index("stage")
    rows = []
    for stage in m.index:
        row = {"group": m.loc[stage, "group"], "requests": int(m.loc[stage, "requests"]),
               "replayed": int(p.loc[stage, "requests"]) if stage in p.index else 0}
        for k in METRICS:
            mv = float(m.loc[stage, k])
            pv = float(p.loc[stage, k]) if stage in p.index else float("nan")
            row[f"{k}_measured"], row[f"{k}_predicted"] = mv, pv
            row[f"{k}_error"] = pv / mv - 1 if mv else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------
# Replay

@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def open_kernel(scenario: str):
    """The kernel of a validation bundle at its shipped constants."""
    import jkernel

    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if scenario in LONG_MAX_MODEL_LEN else {}
    local = SCENARIOS / f"{scenario}.yaml"
    with _env(**env):
        return jkernel.open(local if local.exists() else scenario)


def replay_run(run: Run, root: str | Path, kernel=None, *, prefix: str = PREFIX_HIT,
               limit: int | None = None, progress: bool = False):
    """Replay one run; returns ``(comparison rows, ReplayResult)``. With ``limit`` only the
    first requests are replayed (and, for the per-request sources, measured)."""
    from jkernel.replay import replay

    k = kernel if kernel is not None else open_kernel(run.scenario)
    reqs = requests_for(run, prefix=prefix, block=int(k.settings.block_size), limit=limit)
    if run.source in ENGINE_CLOCK:
        # times from the engine's arrival: the API server's front end is not in them
        from jkernel.calibration.fit.serving import FRONT_END

        k = k.with_params(k.params.replace(**{n: 0.0 for n in FRONT_END if n in k.params}))
    res = replay(k, reqs, progress=progress)
    meas = measured(run, root, reqs if run.source != "trainval" else None)
    pred = predicted(run, res.requests)
    if run.source == "trainval":
        meas = meas[meas["stage"].isin(pred["stage"])]
    rows = compare(meas, pred)
    rows.insert(0, "run", run.run)
    rows.insert(0, "source", run.source)
    for key, v in run.describe().items():
        rows[key] = v
    rows["scenario"] = run.scenario
    rows["preemptions"] = int(res.summary["preemptions"])
    rows["rejected"] = int(res.summary["rejected"])
    rows["kv_usage_peak"] = float(res.summary["kv_usage_peak"])
    rows["steps"] = int(res.summary["steps"])
    rows["prefix"] = prefix if run.source == "trainval" else "none"
    t = res.requests
    if "warm_up" in t.columns:
        t = t[~t["warm_up"].astype(bool)]
    rows["cached_fraction"] = float(t["cached_tokens"].sum() / max(t["input_tokens"].sum(), 1))
    return rows, res


def _save(folder: Path, run: Run, res) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{run.source}__{run.run.replace('/', '_').replace(' ', '_')}"
    res.requests.drop(columns=[c for c in ("block_hashes",) if c in res.requests.columns]) \
        .to_csv(folder / f"{stem}.requests.csv.gz", index=False)
    res.steps.to_csv(folder / f"{stem}.steps.csv.gz", index=False)


def baseline(root: str | Path, *, sources=SOURCES, runs=None, limit: int | None = None,
             prefix: str = PREFIX_HIT, progress: bool = False, log=None,
             save: str | Path | None = None) -> pd.DataFrame:
    """The baseline table: every run of ``root`` replayed as shipped, one row per group with
    the measured, predicted and error columns of :func:`compare`, the run's model, family,
    chip, bundle and ``split`` (``fit`` or ``held-out``, :func:`held_out`)."""
    found = discover(root, sources, runs)
    if not found:
        raise ValueError(f"{root}: no serving runs found for sources {list(sources)}")
    kernels: dict = {}
    tables = []
    for run in found:
        t0 = time.perf_counter()
        if run.scenario not in kernels:
            kernels[run.scenario] = open_kernel(run.scenario)
        rows, res = replay_run(run, root, kernels[run.scenario], prefix=prefix, limit=limit,
                               progress=progress)
        rows["wall_s"] = time.perf_counter() - t0
        tables.append(rows)
        if save:
            _save(Path(save), run, res)
        if log:
            log(f"{run.source:13} {run.run:50} {len(res.requests):6d} requests "
                f"{res.summary['steps']:7d} steps {rows['wall_s'].iloc[0]:6.1f} s")
    table = pd.concat(tables, ignore_index=True)
    split = {}
    for source in table["source"].unique():
        names = table.loc[table["source"] == source, "run"].unique()
        out = held_out(source, names) if runs is None else held_out(
            source, [r.run for r in discover(root, (source,))])
        split.update({(source, n): "held-out" if n in out else "fit" for n in names})
    table["split"] = [split[(s, r)] for s, r in zip(table["source"], table["run"])]
    return table


# --------------------------------------------------------------------------------------
# The run manifest of the serving fit

#: llm-d load points whose TTFT the fit uses: to 20 req/s. Above it the measured TTFT
#: grows with the prompt's length by 100–300 µs per token (4–14 µs below), far more than
#: the prefill of its uncached part: a queue before the engine (the API server of vLLM
#: 0.8.5 tokenising and streaming for 100+ requests) that the front end's constants do not
#: model. Every load point's ITL is used: with the conversations the replay sends
#: (LLMD_CONVERSATIONS) the cache state is known, and the step price is what ITL measures.
#: (Until the conversations were known, ITL above 30 req/s was left out: BASELINE.md §4.)
LLMD_TTFT_TO = 20.0
#: The residency-vllm runs (vLLM 0.23.0, Qwen3-14B, one H100): name → folder.
RESIDENCY = {"2rps": "sweep_rate/agg_2rps/patched",
             "2rps-1T": "sweep_tenants/1T_agg_2rps/patched",
             "4rps": "sweep_rate/agg_4rps/patched", "6rps": "sweep_rate/agg_6rps/patched",
             "8rps": "sweep_rate/agg_8rps/patched"}


def manifest_document(data: str | Path, *, serving: str = "serving-runs",
                      residency: str = "residency-vllm",
                      scenarios: str = "scenarios", workloads: str = "workloads") -> dict:
    """The run manifest (:mod:`jkernel.calibration.data.serving`) of every run of the
    shared data folder ``data`` (``serving-runs/`` and ``residency-vllm/`` under it): the
    trainval stages with their measured means inline (``runs.csv``; the server's output
    length), llm-d's lmbench files, LLMServingSim's engine-clock tables and the residency
    client traces. Paths are relative to ``data`` (the manifest's ``root`` is left to the
    command line's ``--data``); bundles relative to the manifest's folder
    (``scenarios``). Splits by :func:`held_out` (the manifest's own rule, stated)."""
    from jkernel.calibration.data.residency import DEFAULT_DEPLOYMENT

    data = Path(data)
    root = data / serving
    runs = []
    tv = pd.read_csv(root / "inference-sim-trainval" / "runs.csv")
    for run in discover(root, ("trainval",)):
        t = tv[(tv["run_id"] == run.run) & (tv["stage_index"] >= 0)].sort_values("stage_index")
        measured = [{"group": int(r["stage_index"]), "requests": int(r["n_requests"]),
                     "output_tokens": float(r["output_len"]),
                     "ttft_mean_ms": round(float(r["ttft_mean_ms"]), 4),
                     "e2e_mean_ms": round(float(r["e2e_mean_ms"]), 4),
                     "ttft_p90_ms": round(float(r["ttft_p90_ms"]), 4),
                     "e2e_p90_ms": round(float(r["e2e_p90_ms"]), 4),
                     "label": f"stage {int(r['stage_index'])} ({r['stage_rate_rps']:g} req/s)"}
                    for _, r in t.iterrows()]
        runs.append({"name": run.run, "source": "trainval",
                     "deployment": f"{scenarios}/{run.scenario}.yaml",
                     "requests": f"{serving}/{run.requests.relative_to(root).as_posix()}",
                     "format": "requests", "groups": "stage", "measured": measured,
                     "prefix": PREFIX_HIT})
    for run in discover(root, ("llm-d",)):
        rate = float(run.run.split()[0])
        fit_on = ["ttft", "itl"] if rate <= LLMD_TTFT_TO else ["itl"]
        runs.append({"name": run.run, "source": "llm-d",
                     "deployment": f"{scenarios}/{run.scenario}.yaml",
                     "requests": f"{serving}/{run.requests.relative_to(root).as_posix()}",
                     "format": "benchmark",
                     "conversations": f"{workloads}/{LLMD_CONVERSATIONS.name}",
                     "fit_on": fit_on})
    for run in discover(root, ("llmservingsim",)):
        entry = {"name": run.run, "source": "llmservingsim",
                 "deployment": f"{scenarios}/{run.scenario}.yaml",
                 "requests": f"{serving}/{run.requests.relative_to(root).as_posix()}",
                 "format": "requests", "clock": "engine"}
        if run.scenario in LONG_MAX_MODEL_LEN:
            entry["env"] = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
        runs.append(entry)
    for name, folder in RESIDENCY.items():
        if (data / residency / folder / "trace.csv").is_file():
            runs.append({"name": name, "source": "residency", "deployment": DEFAULT_DEPLOYMENT,
                         "requests": f"{residency}/{folder}/trace.csv", "format": "requests"})
    for source in {r["source"] for r in runs}:
        names = [r["name"] for r in runs if r["source"] == source]
        out = held_out(source, names)
        for r in runs:
            if r["source"] == source:
                r["split"] = "held-out" if r["name"] in out else "fit"
    return {"kind": "ServingRuns", "version": 1, "runs": runs}


def write_manifest(data: str | Path, path: str | Path) -> None:
    """Write :func:`manifest_document` of ``data`` as YAML at ``path`` (bundles relative to
    ``path``'s folder, the validation bundles)."""
    path = Path(path)
    rel = os.path.relpath(SCENARIOS, path.resolve().parent)
    wl = os.path.relpath(LLMD_CONVERSATIONS.parent, path.resolve().parent)
    doc = manifest_document(data, scenarios=Path(rel).as_posix(), workloads=Path(wl).as_posix())
    if path.resolve().parent.is_relative_to(Path(data).resolve()):
        # a manifest inside its data folder (the tests' excerpt) names it as its root
        root = Path(os.path.relpath(Path(data).resolve(), path.resolve().parent)).as_posix()
        doc = {"kind": doc["kind"], "version": doc["version"], "root": root,
               "runs": doc["runs"]}
    head = ("# The serving runs of a data folder (serving-runs/ and residency-vllm/) as a run\n"
            "# manifest of the serving fit (jkernel/calibration/data/serving.py). Written by\n"
            "#   python -m validation.serving_runs --data <data>/serving-runs "
            f"--write-manifest {path.as_posix()}\n"
            "# Data paths are relative to that data folder: pass it as --data (or root).\n")
    path.write_text(head + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True),
                    encoding="utf-8")


# --------------------------------------------------------------------------------------
# Prefix-cache hypothesis

def prefix_study(root: str | Path, *, runs=None, limit: int | None = 600,
                 progress: bool = False, log=None) -> pd.DataFrame:
    """Replay the first ``limit`` requests (the first load stage) of each trainval run under
    each prefix-cache hypothesis of :data:`PREFIXES`; one row per run and hypothesis with the
    measured stage-0 mean TTFT, the predicted one and their difference (measured −
    predicted, ms). The right hypothesis leaves a difference that does not grow with the
    prefill the hypothesis removes (the front end before the first step is the same few ms
    for every model); a wrong one leaves the prefill's cost, which scales with the model."""
    found = discover(root, ("trainval",), runs)
    kernels: dict = {}
    rows = []
    for run in found:
        if run.scenario not in kernels:
            kernels[run.scenario] = open_kernel(run.scenario)
        k = kernels[run.scenario]
        for prefix in PREFIXES:
            cmp, res = replay_run(run, root, k, prefix=prefix, limit=limit, progress=progress)
            first = cmp.iloc[0]
            done = res.requests
            warm = done.iloc[min(100, len(done) - 1):]
            rows.append({"run": run.run, "model": cmp["model"].iloc[0], "prefix": prefix,
                         "measured_ttft_ms": first["ttft_mean_measured"] * 1e3,
                         "predicted_ttft_ms": first["ttft_mean_predicted"] * 1e3,
                         "warm_predicted_ttft_ms": float(warm["ttft_s"].mean()) * 1e3,
                         "cached_fraction": cmp["cached_fraction"].iloc[0]})
            if log:
                log(f"prefix {prefix:6} {run.run:50} TTFT measured "
                    f"{rows[-1]['measured_ttft_ms']:7.2f} ms, predicted "
                    f"{rows[-1]['predicted_ttft_ms']:7.2f} ms")
    t = pd.DataFrame(rows)
    t["difference_ms"] = t["measured_ttft_ms"] - t["predicted_ttft_ms"]
    return t


def prefix_summary(study: pd.DataFrame) -> pd.DataFrame:
    """Per hypothesis: mean, standard deviation and range over runs of measured − predicted
    stage-0 TTFT (ms), and the number of runs where the prediction exceeds the measurement."""
    g = study.groupby("prefix", sort=False)["difference_ms"]
    out = pd.DataFrame({"mean_ms": g.mean(), "std_ms": g.std(ddof=0), "min_ms": g.min(),
                        "max_ms": g.max(),
                        "runs_predicted_above": study.assign(a=study["difference_ms"] < 0)
                        .groupby("prefix", sort=False)["a"].sum()})
    return out.reset_index()


# --------------------------------------------------------------------------------------
# Summaries and output

def medians(table: pd.DataFrame, by: str) -> pd.DataFrame:
    """Median signed and absolute error of each metric over the table's rows, per value of
    ``by`` (``source``, ``chip``, ``family``) and split (``fit``, ``held-out``, ``all``)."""
    rows = []
    for key, g in table.groupby(by, sort=True):
        for split, h in (("fit", g[g["split"] == "fit"]), ("held-out", g[g["split"] == "held-out"]),
                         ("all", g)):
            if h.empty:
                continue
            row = {by: key, "split": split, "rows": len(h), "runs": h["run"].nunique()}
            for m in METRICS:
                e = h[f"{m}_error"].dropna()
                row[f"{m}_median"] = float(e.median()) if len(e) else float("nan")
                row[f"{m}_median_abs"] = float(e.abs().median()) if len(e) else float("nan")
            rows.append(row)
    return pd.DataFrame(rows)


def _pct(x: float) -> str:
    return "–" if not np.isfinite(x) else f"{x * 100:+.1f}".replace("-", "\u2212")


def _val(x: float, metric: str) -> str:
    if not np.isfinite(x):
        return "–"
    return f"{x:.2f} s" if metric.startswith("e2e") and x >= 10 else f"{x * 1e3:.1f}"


def markdown_runs(table: pd.DataFrame, source: str) -> str:
    """The per-run table of one source: measured → predicted (error %) per metric; TTFT and
    ITL in ms, E2E in ms (or s where ≥ 10 s)."""
    t = table[table["source"] == source]
    head = ["run", "group", "split", "n"] + [m.replace("_", " ") for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in t.iterrows():
        cells = [r["run"], r["group"], r["split"], str(int(r["requests"]))]
        for m in METRICS:
            cells.append(f"{_val(r[f'{m}_measured'], m)} → {_val(r[f'{m}_predicted'], m)} "
                         f"({_pct(r[f'{m}_error'])})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_medians(med: pd.DataFrame, by: str) -> str:
    """Medians as Markdown: signed median (median |error|) per metric, in %."""
    head = [by, "split", "rows (runs)"] + [m.replace("_", " ") for m in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in med.iterrows():
        cells = [str(r[by]), r["split"], f"{int(r['rows'])} ({int(r['runs'])})"]
        for m in METRICS:
            a = r[f"{m}_median_abs"]
            cells.append("–" if not np.isfinite(a) else
                         f"{_pct(r[f'{m}_median'])} ({a * 100:.1f})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(table: pd.DataFrame) -> str:
    """The whole baseline as Markdown: per source the run table, then the medians per
    source, chip and model family."""
    parts = []
    for source in [s for s in SOURCES if s in set(table["source"])]:
        parts.append(f"### {source}\n\n" + markdown_runs(table, source))
    for by in ("source", "chip", "family"):
        parts.append(f"### Medians per {by}\n\n" + markdown_medians(medians(table, by), by))
    return "\n\n".join(parts) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m validation.serving_runs",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="../shared/data/serving-runs",
                   help="the serving-runs folder (or an excerpt with its layout)")
    p.add_argument("--sources", nargs="*", default=list(SOURCES), choices=SOURCES)
    p.add_argument("--runs", nargs="*", default=None, help="only these run names")
    p.add_argument("--limit", type=int, default=None, help="first N requests of each run")
    p.add_argument("--prefix", choices=PREFIXES, default=PREFIX_HIT,
                   help=f"trainval prefix-cache hypothesis (default {PREFIX_HIT})")
    p.add_argument("--prefix-study", action="store_true",
                   help="print the evidence for the prefix-cache hypothesis instead")
    p.add_argument("--markdown", default=None, help="write the tables as Markdown here")
    p.add_argument("--csv", default=None, help="write the table as CSV here")
    p.add_argument("--save", default=None, help="write each replay's request and step tables "
                                                "(compressed CSV) into this folder")
    p.add_argument("--write-manifest", default=None, metavar="FILE",
                   help="write the run manifest of the serving fit (every run of the data "
                        "folder's parent: serving-runs/ and residency-vllm/) and stop")
    p.add_argument("--progress", action="store_true", help="a progress bar per replay")
    p.add_argument("--quiet", action="store_true", help="no per-run lines on stderr")
    a = p.parse_args(argv)
    if not Path(a.data).is_dir():
        print(f"{a.data}: no such folder (the serving-runs data)", file=sys.stderr)
        return 2
    if a.write_manifest:
        write_manifest(Path(a.data).resolve().parent, a.write_manifest)
        return 0
    import jkernel

    jkernel.enable_x64()
    log = None if a.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    if a.prefix_study:
        study = prefix_study(a.data, runs=a.runs, limit=a.limit or 600, log=log,
                             progress=a.progress)
        pd.set_option("display.width", 200)
        print(study.to_string(index=False, float_format=lambda x: f"{x:.2f}"))
        print(prefix_summary(study).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
        if a.csv:
            study.to_csv(a.csv, index=False)
        return 0
    table = baseline(a.data, sources=a.sources, runs=a.runs, limit=a.limit, prefix=a.prefix,
                     progress=a.progress, log=log, save=a.save)
    text = markdown(table)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text, encoding="utf-8")
    if a.csv:
        table.to_csv(a.csv, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
