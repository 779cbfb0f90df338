"""calibration/ is a DAG of layers (base ← primitives and trace fit ← chip fit ← importers,
reports, regeneration, command line) and sets no jax.config at import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "calibration"
#: Layer of every module; a module may import only modules of a lower layer (or its own
#: layer where listed in SAME_LAYER).
LAYERS = {"uncertainty": 0, "base": 1, "profiles": 2, "gemm": 3, "attention": 3, "moe": 3,
          "collectives": 3, "traces": 3, "validate": 4, "stepfit": 5, "fit": 6,
          "importers": 7, "residency": 8, "report": 7, "seed": 8, "regenerate": 9,
          "stepreport": 10, "__main__": 10, "__init__": 0}
SAME_LAYER = {("moe", "gemm")}


def _imports(path: Path) -> set[str]:
    out = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.ImportFrom) and n.level == 1:
            out |= {n.module.split(".")[0]} if n.module else {a.name for a in n.names}
    return out


def test_every_module_has_a_layer():
    assert {p.stem for p in PKG.glob("*.py")} == set(LAYERS)


def test_imports_only_go_down_the_layers():
    """Each relative import (module level or inside a function) points to a lower layer, so
    the package has no import circle (before: fit imported the primitives, which imported
    fit; collectives imported seed, which imported report, which imported fit)."""
    bad = []
    for p in PKG.glob("*.py"):
        for dep in _imports(p) & set(LAYERS):
            if LAYERS[dep] >= LAYERS[p.stem] and (p.stem, dep) not in SAME_LAYER:
                bad.append(f"{p.stem} (layer {LAYERS[p.stem]}) imports {dep} "
                           f"(layer {LAYERS[dep]})")
    assert not bad, bad


def test_no_jax_config_at_import():
    """Importing every module leaves JAX's configuration alone (entry points set float64)."""
    code = ("import jax, importlib\n"
            f"for m in {sorted(m for m in LAYERS if m != '__init__')!r}:\n"
            "    importlib.import_module('calibration.' + m)\n"
            "print(jax.config.jax_enable_x64)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PKG.parent, check=True).stdout.strip()
    assert out == "False"
    for p in PKG.glob("*.py"):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in tree.body:          # module-level statements only
            assert "jax.config.update" not in ast.unparse(node), p.name
