"""Regenerate the residency-vllm fixtures from the shared data folder.

    python tests/data/residency-vllm/make_fixtures.py ../shared/data/residency-vllm

* ``agg_2rps_head.csv``: the first 60 rows of ``sweep_rate/agg_2rps/patched/trace.csv``,
  unchanged (every column, the client trace format as the source writes it);
* ``runs.csv``: per run, the measured client timings summarised the way the validation
  compares them (``validation/replay.py``'s ``measured_summary``), so that the replay notebook
  can show the comparison on a clone without the shared data.
"""

import json
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from validation.replay import RUNS, measured_summary  # noqa: E402


def main(src: str) -> None:
    root = Path(src)
    trace = pd.read_csv(root / RUNS[0][1] / "trace.csv")
    trace.head(60).to_csv(HERE / "agg_2rps_head.csv", index=False)
    rows = []
    for name, folder in RUNS:
        t = pd.read_csv(root / folder / "trace.csv")
        sj = json.loads((root / folder / "summary.json").read_text())
        rows.append({"run": name, "folder": folder, **measured_summary(t, sj)})
    pd.DataFrame(rows).to_csv(HERE / "runs.csv", index=False, float_format="%.6g")


if __name__ == "__main__":
    main(sys.argv[1])
