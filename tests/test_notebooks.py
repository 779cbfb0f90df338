"""Every notebook in notebooks/ executes headless; a failing cell fails the test run.

The notebooks are committed with their outputs, so a reader sees the plots without running
anything; the second test checks that they were. Executing them is slow (each takes up to
three minutes on two CPU cores), so the test is marked ``slow``, and it still runs by default:
deselect it with ``-m "not slow"``.

Each prints how long it took; speed is not asserted here (a loaded machine is slow), only
that every cell runs, within nbclient's per-cell timeout.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _needs():
    missing = []
    for mod in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        pytest.skip(f"notebook execution needs {', '.join(missing)} "
                    "(pip install 'jkernel[notebooks]')")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_with_outputs(path):
    nb = json.loads(path.read_text(encoding="utf-8"))
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{path.name} has no code cells"
    unrun = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unrun, f"{path.name}: code cells {unrun} have no outputs; execute and save it"
    errors = [i for i, c in enumerate(code)
              if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert not errors, f"{path.name}: code cells {errors} were saved with an error"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    _needs()
    import matplotlib
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    matplotlib.use("Agg")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The notebooks find the repository themselves; this also helps an uninstalled checkout.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    nb = nbformat.read(str(path), as_version=4)           # executed in memory, never saved
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name}: a cell failed:\n{e}")
    took = time.perf_counter() - start
    print(f"{path.name}: {took:.1f} s")
