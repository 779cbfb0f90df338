"""Regenerate ``lmbench-sharegpt.csv``: the conversations behind the llm-d lmbench runs.

    python validation/workloads/make_lmbench_sharegpt.py RUN_JSON WARMUP_JSON LMBENCH_CSV

``RUN_JSON`` and ``WARMUP_JSON`` are ``sharegpt/run.json`` and ``sharegpt/warmup.json`` of
``LMCache/LMBenchmark`` at c82da35 (2 May 2025, the workload files of the May 2025 llm-d
runs); ``LMBENCH_CSV`` is any load point of
``../shared/data/serving-runs/llm-d-lmbench/exp4_scout_fp8_tp4_h100/`` (every load point
sent the same prompts; their server token counts are identical). README.md says what the
table holds and how the warm-up prompts' token counts are estimated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
OUT = HERE / "lmbench-sharegpt.csv"
#: Tokens the chat template puts around one user message (Llama 4: begin-of-text and the
#: user header before it, end-of-turn and the assistant header after it).
TEMPLATE_TOKENS = 10
#: Tokens of the "<qps> " the client puts before every prompt of a load point.
QPS_TOKENS = 3


def conversations(run: list[dict], warm: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per run entry (send order) and per warm-up entry: its conversation and round. A run
    entry's text begins with the text of the conversation's previous entry (its last run
    entry, else its warm-up entry: the ShareGPT conversation so far)."""
    texts = [e["input"] for e in run]
    wtexts = [e["input"] for e in warm]
    rows = []
    for i, s in enumerate(texts):
        for j in range(i - 1, -1, -1):
            if s.startswith(texts[j]):
                rows.append((rows[j][0], rows[j][1] + 1))
                break
        else:
            first = [k for k, t in enumerate(wtexts) if s.startswith(t)]
            if not first:
                raise ValueError(f"run entry {i} continues no earlier prompt")
            rows.append((first[0], 3))
    r = pd.DataFrame(rows, columns=["conversation", "round"])
    r["chars"] = [len(s) for s in texts]
    w = pd.DataFrame({"conversation": np.arange(len(warm)), "round": 2,
                      "chars": [len(s) for s in wtexts],
                      "output_tokens": [max(int(e.get("output_length", 20)), 1) for e in warm]})
    return r, w


def table(run: list[dict], warm: list[dict], measured: pd.DataFrame) -> pd.DataFrame:
    r, w = conversations(run, warm)
    if len(measured) != len(r):
        raise ValueError(f"{len(measured)} measured requests against {len(r)} run entries")
    tokens = measured["input_tokens"].to_numpy()
    # tokens per character of each conversation's first run prompt (round 3), which begins
    # with the warm-up prompt: the warm-up prompt's tokens at that rate
    content = (tokens - TEMPLATE_TOKENS - QPS_TOKENS) / r["chars"].to_numpy()
    first = r["round"].to_numpy() == 3
    rate = pd.Series(content[first], index=r["conversation"].to_numpy()[first])
    wt = TEMPLATE_TOKENS + QPS_TOKENS + w["chars"].to_numpy() * rate.loc[w["conversation"]].to_numpy()
    warm_rows = pd.DataFrame({"phase": "warm-up",
                              "request_id": [f"warm-up-{k}" for k in range(len(w))],
                              "conversation": w["conversation"], "round": 2,
                              "input_tokens": np.rint(wt).astype(int),
                              "output_tokens": w["output_tokens"]})
    run_rows = pd.DataFrame({"phase": "run", "request_id": measured["request_id"].astype(str),
                             "conversation": r["conversation"], "round": r["round"],
                             "input_tokens": pd.NA, "output_tokens": pd.NA})
    return pd.concat([warm_rows, run_rows], ignore_index=True)


def main(argv=None) -> int:
    a = argv if argv is not None else sys.argv[1:]
    if len(a) != 3:
        print(__doc__)
        return 2
    run = json.loads(Path(a[0]).read_text())
    warm = json.loads(Path(a[1]).read_text())
    t = table(run, warm, pd.read_csv(a[2]))
    t.to_csv(OUT, index=False)
    print(f"wrote {OUT} ({(t['phase'] == 'warm-up').sum()} warm-up, {(t['phase'] == 'run').sum()} "
          f"run requests, {t['conversation'].nunique()} conversations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
