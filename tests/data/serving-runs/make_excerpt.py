"""Regenerate this excerpt of the serving-runs data set from the shared folder.

    python tests/data/serving-runs/make_excerpt.py /path/to/shared/data/serving-runs

Lines are taken by position (the header, then the first data lines of a file, of each load
stage, or of one run), never sampled, and copied byte for byte; see README.md.
"""

from __future__ import annotations

import csv
import io
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAINVAL_RUN = "20260217-155451-llama-2-7b-tp1-codegen"     # two load stages, Llama-2-7b
PER_STAGE = 60
LLMD_FILE = "LMBench_sharegpt_output_4.csv"
LLMSERVINGSIM_RUN = "RTX4090_Llama-3.1-8B"
FIRST = 60


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def _field(line: bytes, index: int) -> str:
    return next(csv.reader(io.StringIO(line.decode())))[index]


def _copy(src: Path, dst: Path, keep) -> None:
    """Header plus the data lines ``keep(line)`` accepts, in file order, byte for byte."""
    lines = _lines(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(b"".join([lines[0]] + [ln for ln in lines[1:] if keep(ln)]))


def _first(n: int):
    seen = [0]

    def keep(_line: bytes) -> bool:
        seen[0] += 1
        return seen[0] <= n
    return keep


def _first_per_stage(n: int, column: int):
    seen: dict[str, int] = {}

    def keep(line: bytes) -> bool:
        stage = _field(line, column)
        seen[stage] = seen.get(stage, 0) + 1
        return seen[stage] <= n
    return keep


def main(src: str) -> None:
    src = Path(src)
    tv_src, tv = src / "inference-sim-trainval", HERE / "inference-sim-trainval"
    _copy(tv_src / "runs.csv", tv / "runs.csv",
          lambda ln: _field(ln, 0) == TRAINVAL_RUN)
    _copy(tv_src / "training_stages.csv", tv / "training_stages.csv",
          lambda ln: _field(ln, 0) == TRAINVAL_RUN)
    header = _lines(tv_src / "requests" / f"{TRAINVAL_RUN}.csv")[0].decode().strip().split(",")
    _copy(tv_src / "requests" / f"{TRAINVAL_RUN}.csv", tv / "requests" / f"{TRAINVAL_RUN}.csv",
          _first_per_stage(PER_STAGE, header.index("stage")))
    folder = "llm-d-lmbench/exp4_scout_fp8_tp4_h100"
    _copy(src / folder / LLMD_FILE, HERE / folder / LLMD_FILE, _first(FIRST))
    folder = f"llmservingsim/{LLMSERVINGSIM_RUN}"
    _copy(src / folder / "requests.csv", HERE / folder / "requests.csv", _first(FIRST))
    shutil.copyfile(src / folder / "meta.json", HERE / folder / "meta.json")


if __name__ == "__main__":
    main(sys.argv[1])
