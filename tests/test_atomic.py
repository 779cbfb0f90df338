"""Outputs are checked before the work and written whole or not at all (jkernel.atomic).

Guards behaviours once seen: on a full disk ``replay --out`` replaced the previous results
with a truncated file; an ``--out`` in a missing folder, or naming a directory, failed with
a raw traceback only after the whole replay had run; ``--out`` equal to ``--requests``
silently overwrote the input; ``plan --csv/--json/--plot`` did the same, and ``--plot``
without matplotlib failed after the whole search; ``derive --out`` at a file raised a raw
traceback and ``derive --name ../../x`` wrote outside ``--out``."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from jkernel import ArgumentError, atomic, cli

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "catalog" / "models" / "llama-3.1-8b-instruct" / "config.json"
SCENARIO = "llama-3.1-8b-h100-tp1"


def run(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def requests_file(tmp_path: Path, n: int = 3) -> Path:
    p = tmp_path / "reqs.csv"
    pd.DataFrame({"request_id": range(n), "arrival_s": [0.1 * i for i in range(n)],
                  "input_tokens": [100] * n, "output_tokens": [4] * n}).to_csv(p, index=False)
    return p


# -- check_target -----------------------------------------------------------------------------

def test_check_target_refuses_what_cannot_be_written(tmp_path):
    (tmp_path / "afile").write_text("x")
    cases = {str(tmp_path): "is a directory", str(tmp_path / "missing" / "x.csv"):
             "does not exist", str(tmp_path / "afile" / "x.csv"): "is not a folder", "":
             "empty"}
    for path, why in cases.items():
        with pytest.raises(ArgumentError, match=why) as info:
            atomic.check_target(path, argument="--out")
        assert info.value.argument == "--out"
    assert atomic.check_target(tmp_path / "new.csv", argument="--out") == tmp_path / "new.csv"


def test_check_target_refuses_an_input_of_the_command(tmp_path, monkeypatch):
    src = tmp_path / "reqs.csv"
    src.write_text("x")
    monkeypatch.chdir(tmp_path)
    for same in (src, "reqs.csv", f"./sub/../reqs.csv"):
        (tmp_path / "sub").mkdir(exist_ok=True)
        with pytest.raises(ArgumentError, match="also an input"):
            atomic.check_target(same, argument="--out", inputs=[str(src)])
    link = tmp_path / "link.csv"
    link.symlink_to(src)
    with pytest.raises(ArgumentError, match="also an input"):
        atomic.check_target(link, argument="--out", inputs=[src])


def test_two_outputs_on_one_file_are_refused(tmp_path):
    with pytest.raises(ArgumentError, match="also the file of --csv") as info:
        atomic.check_targets({"--csv": tmp_path / "a", "--json": tmp_path / "a"})
    assert info.value.argument == "--json"


# -- replacing --------------------------------------------------------------------------------

def _folder(tmp_path: Path) -> set[str]:
    return {p.name for p in tmp_path.iterdir()}


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    """A full disk (ENOSPC, simulated in the writer) once truncated the previous results."""
    target = tmp_path / "out.csv"
    target.write_text("previous results\n")
    before = _folder(tmp_path)

    def writer(tmp: Path):
        tmp.write_text("half a tab")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    with pytest.raises(OSError, match="No space left"):
        atomic.write_with(target, writer)
    assert target.read_text() == "previous results\n"
    assert _folder(tmp_path) == before


def test_an_interrupted_write_leaves_the_previous_file(tmp_path):
    target = tmp_path / "out.csv"
    target.write_text("previous\n")

    def writer(tmp: Path):
        tmp.write_text("partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic.write_with(target, writer)
    assert target.read_text() == "previous\n" and _folder(tmp_path) == {"out.csv"}


def test_a_complete_write_replaces_the_file_keeping_its_mode(tmp_path):
    target = tmp_path / "out.png"
    target.write_text("old")
    os.chmod(target, 0o640)
    seen = []
    atomic.write_with(target, lambda tmp: (seen.append(tmp.suffix), tmp.write_text("new")))
    assert target.read_text() == "new" and seen == [".png"]   # writers see the suffix
    assert target.stat().st_mode & 0o777 == 0o640
    assert _folder(tmp_path) == {"out.png"}


def test_replay_out_keeps_the_previous_file_when_the_disk_fills(tmp_path):
    """End to end on a real write failure: ``jkernel replay --out`` in a process whose file
    size limit (RLIMIT_FSIZE) stops the write part way, as a full disk would."""
    reqs = requests_file(tmp_path, 40)
    out = tmp_path / "latencies.csv"
    previous = "request_id,ttft_s\n" + "".join(f"{i},0.5\n" for i in range(10))
    out.write_text(previous)
    limit = 2048                       # the new table is ~6 KB: the write fails part way

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a failed write, not a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    env = dict(os.environ, PYTHONPATH=str(ROOT), JKERNEL_CACHE_DIR="0",
               PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([sys.executable, "-m", "jkernel", "replay", SCENARIO, "--requests",
                        str(reqs), "--out", str(out), "--no-progress"], env=env,
                       preexec_fn=small_files, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "File too large" in p.stderr and "Traceback" not in p.stderr
    assert out.read_text() == previous
    assert _folder(tmp_path) == {"reqs.csv", "latencies.csv"}


# -- the commands check their outputs before the work ----------------------------------------

@pytest.mark.parametrize("out, why", [("missing/x.csv", "does not exist"),
                                      (".", "is a directory"),
                                      ("reqs.csv", "also an input")])
def test_replay_out_is_checked_before_the_replay(tmp_path, monkeypatch, out, why):
    reqs = requests_file(tmp_path)
    before = reqs.read_text()
    monkeypatch.chdir(tmp_path)
    import jkernel.replay as replay_mod

    monkeypatch.setattr(replay_mod, "replay", lambda *a, **k: pytest.fail("replay ran"))
    rc, _, err = run(["replay", SCENARIO, "--requests", "reqs.csv", "--out", out])
    assert rc == 2 and f"--out: " in err and why in err and "Traceback" not in err
    assert reqs.read_text() == before


PLAN = ["plan", "llama-3.1-8b-instruct", "--chip", "h100", "--gpus", "1", "--isl", "64",
        "--osl", "4", "--rate", "1", "--workers", "1"]


@pytest.mark.parametrize("extra, argument, why", [
    (["--csv", "{tmp}"], "--csv", "is a directory"),
    (["--json", "{tmp}/missing/t.json"], "--json", "does not exist"),
    (["--plot", "{tmp}/afile/p.png"], "--plot", "is not a folder"),
    (["--csv", "{tmp}/t", "--json", "{tmp}/t"], "--json", "also the file of --csv"),
])
def test_plan_outputs_are_checked_before_the_search(tmp_path, monkeypatch, extra, argument,
                                                    why):
    (tmp_path / "afile").write_text("x")
    from jkernel import search

    monkeypatch.setattr(search, "plan", lambda *a, **k: pytest.fail("the search ran"))
    rc, _, err = run(PLAN + [x.format(tmp=tmp_path) for x in extra])
    assert rc == 2 and f"{argument}: " in err and why in err


def test_plan_plot_without_matplotlib_is_refused_before_the_search(monkeypatch, tmp_path):
    """--plot without matplotlib failed with an ImportError after the whole search."""
    import importlib.util

    from jkernel import search

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(search, "plan", lambda *a, **k: pytest.fail("the search ran"))
    rc, _, err = run(PLAN + ["--plot", str(tmp_path / "f.png")])
    assert rc == 2 and "--plot: needs matplotlib" in err


# -- derive -----------------------------------------------------------------------------------

def test_derive_out_at_a_file_or_a_missing_folder_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    for out, why in ((tmp_path / "afile", "is a file"), (tmp_path / "nope", "does not exist")):
        rc, _, err = run(["derive", str(CONFIG), "--name", "m", "--out", str(out)])
        assert rc == 2 and "--out: " in err and why in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "/abs", "", "x" * 200, ".hidden"])
def test_derive_name_is_a_catalog_name_never_a_path(tmp_path, name):
    """``derive --name ../../x`` wrote outside --out."""
    models = tmp_path / "a" / "b" / "models"
    models.mkdir(parents=True)
    rc, _, err = run(["derive", str(CONFIG), "--name", name, "--out", str(models)])
    assert rc == 2 and "name" in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "models"]


def test_derive_writes_the_three_files_whole(tmp_path):
    rc, out, _ = run(["derive", str(CONFIG), "--name", "m-1", "--out", str(tmp_path)])
    assert rc == 0
    assert sorted(p.name for p in (tmp_path / "m-1").iterdir()) == ["config.json",
                                                                   "graph.yaml", "model.yaml"]
    assert (tmp_path / "m-1" / "config.json").read_bytes() == CONFIG.read_bytes()


def test_a_coefficient_set_written_on_a_full_disk_leaves_the_previous_set(tmp_path, monkeypatch):
    """Calibration's outputs (coefficient sets, reports, traces) go through the same
    atomic write: a set written over a full disk once could leave a truncated catalog file."""
    from jkernel.calibration.report.coefficients import write_coefficient_set
    from jkernel.documents.coefficients import Entry, Scope

    path = tmp_path / "mine.yaml"
    entry = Entry("host_serial", 800.0, "us", "fitted", True, Scope(hardware=("h100",)),
                  rationale="r")
    write_coefficient_set(path, "mine", [entry])
    before = path.read_bytes()

    real = Path.write_text

    def full_disk(self, text, *a, **k):
        real(self, text[: len(text) // 2], *a, **k)          # half written, then no space
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "write_text", full_disk)
    more = [entry, Entry("host_completion", 9.0, "us_per_request", "measured", True,
                         Scope(hardware=("h100",)), rationale="r")]
    with pytest.raises(OSError, match="No space"):
        write_coefficient_set(path, "mine", more)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["mine.yaml"]
