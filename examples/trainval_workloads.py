"""The workload specs of the 15 inference-sim trainval runs: write them, check that they
regenerate the runs' request files' statistics, and that replaying a spec gives the same
figures as replaying its run's request file (docs/workloads.md, "Worked example").

    python examples/trainval_workloads.py ../shared/data/serving-runs/inference-sim-trainval \\
        [--write docs/workloads/inference-sim-trainval] [--replay] [--markdown]

The runs' load generator was inference-perf: per stage, ``int(rate × duration)`` exponential
gaps rescaled to the stage's duration (its ``constant`` load type), prompts from a pool of
10 groups × 10 prompts sharing a system prompt per group, shuffled once, request i sending
prompt i mod 100. The request files are regenerated (README of the data), unseeded in the
original: statistics agree, single requests do not. A request file is replayed with its
``shared_prefix_tokens`` as ``prefix_length`` and its ``prompt_id`` as ``prompt_key`` (the
same prompt is the same tokens), exactly as the spec's requests carry them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

POOL_GROUPS, POOL_PER_GROUP = 10, 10


def spec_text(run: pd.DataFrame) -> str:
    """The spec of one run (its rows of runs.csv) as YAML text."""
    whole = run[run.stage_index == -1].iloc[0]
    stages = run[run.stage_index >= 0].sort_values("stage_index")
    lines = [f"# {whole.run_id}: {whole.model}, TP {whole.tp}, workload {whole.workload}",
             "# inference-sim-trainval (runs.csv); inference-perf's constant load type:",
             "# int(rate x duration) exponential gaps per stage, rescaled to the stage.",
             "seed: 0",
             "arrival:",
             "  process: poisson",
             "  rescale: true",
             "  stages:"]
    for st in stages.itertuples():
        lines.append(f"    - {{rate: {st.stage_rate_rps:g}, duration_s: {st.stage_duration_s:g}}}")
    lines += [f"input_tokens: {int(whole.question_len)}        # question_len",
              f"output_tokens: {int(whole.output_len)}       # output_len (ignore_eos)",
              "prefix:                  # 10 groups x 10 prompts, one system prompt per group",
              f"  groups: {POOL_GROUPS}",
              f"  tokens: {int(whole.system_prompt_len)}             # system_prompt_len",
              f"  prompts_per_group: {POOL_PER_GROUP}",
              "  order: shuffled"]
    return "\n".join(lines) + "\n"


def from_file(path: Path) -> pd.DataFrame:
    """A run's request file in the replay's vocabulary."""
    from jkernel.replay import load_requests

    raw = pd.read_csv(path)
    raw["prefix_length"] = raw["shared_prefix_tokens"]
    raw["prompt_key"] = raw["prompt_id"]
    return load_requests(raw.drop(columns=["shared_prefix_tokens"]))


def statistics(df: pd.DataFrame, durations: list[float]) -> dict:
    """Per stage: requests and rate; lengths; prefix sharing."""
    out: dict = {}
    start = 0.0
    for k, dur in enumerate(durations):
        st = df[df["stage"] == k]
        out[f"stage{k}_requests"] = len(st)
        out[f"stage{k}_rate"] = len(st) / dur
        out[f"stage{k}_last_s"] = float(st["arrival_s"].max()) - start
        gaps = np.diff(st["arrival_s"].to_numpy())
        out[f"stage{k}_gap_cv"] = float(gaps.std() / gaps.mean())      # 1 for Poisson
        start += dur
    out["input_mean"] = float(df["input_tokens"].mean())
    out["output_mean"] = float(df["output_tokens"].mean())
    out["groups"] = int(df["prefix_group"].nunique())
    out["prompts"] = int(df["prompt_key"].nunique())
    per = df.groupby("prefix_group")["prompt_key"].nunique()
    out["prompts_per_group"] = f"{per.min()}-{per.max()}"
    out["prefix_tokens"] = float(df["prefix_length"].mean())
    key = df["prompt_key"].to_numpy()
    n = len(key) // 100 * 100
    out["cycles_of_100"] = bool(all(len(set(key[i:i + 100])) == 100 for i in range(0, n, 100))
                                and (key[100:] == key[:-100]).all())
    return out


def deployment(model: str) -> str:
    return "llama-3.1-70b-h100-tp4" if "70B" in model else "llama-3.1-8b-h100-tp1"


FIGURES = ("ttft_mean_s", "ttft_p90_s", "itl_mean_s", "e2e_mean_s", "e2e_p90_s",
           "output_tokens_per_s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data", type=Path)
    ap.add_argument("--write", type=Path, default=None, help="write the specs here")
    ap.add_argument("--replay", action="store_true", help="replay spec and file")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    import jkernel
    from jkernel.replay import load_workload, replay

    runs = pd.read_csv(args.data / "runs.csv")
    rows = []
    for run_id, run in runs.groupby("run_id", sort=False):
        text = spec_text(run)
        if args.write:
            args.write.mkdir(parents=True, exist_ok=True)
            (args.write / f"{run_id}.yaml").write_text(text)
        import yaml

        wl = load_workload(yaml.safe_load(text))
        durations = [float(d) for d in run[run.stage_index >= 0].sort_values(
            "stage_index")["stage_duration_s"]]
        file_df = from_file(args.data / "requests" / f"{run_id}.csv")
        a, b = statistics(wl.requests, durations), statistics(file_df, durations)
        row = {"run": run_id}
        for k in a:
            row[f"{k} spec/file"] = (f"{a[k]:.3f}/{b[k]:.3f}" if isinstance(a[k], float)
                                     else f"{a[k]}/{b[k]}")
        if args.replay:
            k = jkernel.open(deployment(run.iloc[0].model))
            rs, rf = replay(k, wl.requests).summary, replay(k, file_df).summary
            for f in FIGURES:
                row[f"{f} spec/file"] = f"{rs[f]:.4g}/{rf[f]:.4g} ({rs[f] / rf[f] - 1:+.1%})"
            row["deployment"] = deployment(run.iloc[0].model)
        rows.append(row)
        print(row, file=sys.stderr, flush=True)
    table = pd.DataFrame(rows)
    print(markdown(table) if args.markdown else table.to_string(index=False))
    return 0


def markdown(table: pd.DataFrame) -> str:
    """The replay columns as a Markdown table (statistics that agree exactly are said so
    once, under the table)."""
    cols = ["run"] + [c for c in table.columns if c.split(" ")[0] in FIGURES]
    lines = ["| " + " | ".join(c.replace(" spec/file", "") for c in cols) + " |",
             "|" + "---|" * len(cols)]
    for row in table.itertuples(index=False):
        d = dict(zip(table.columns, row))
        lines.append("| " + " | ".join(str(d[c]) for c in cols) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
