"""jkernel/calibration/ is layered as its README's layer table says (data ← fit ← report ←
drivers, each module importing only modules of a lower layer), every module has a row in
that table, and no module sets jax.config at import."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "jkernel" / "calibration"
README = PKG / "README.md"
ROW = re.compile(r"^\| (\d+) \| `([\w/]+)` \| (.+) \|$")


def layer_table() -> dict[str, int]:
    """Module (path under jkernel/calibration without ``.py``, e.g. ``fit/base``) → layer,
    from the table under the README's ``## Layers`` heading."""
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    table: dict[str, int] = {}
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            assert m[2] not in table, f"{m[2]} has two rows in the layer table"
            assert m[3].strip(), f"{m[2]} has no job in the layer table"
            table[m[2]] = int(m[1])
    return table


def _modules() -> dict[str, Path]:
    return {p.relative_to(PKG).with_suffix("").as_posix(): p for p in PKG.rglob("*.py")}


def _resolve(dotted: str, known: set[str]) -> str | None:
    """A dotted name under jkernel.calibration (``fit.base``) as a module of the table."""
    path = dotted.replace(".", "/")
    if path in known:
        return path
    if f"{path}/__init__" in known or path == "":
        return f"{path}/__init__".lstrip("/")
    return None


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere (module level or inside a
    function): relative imports and absolute ``jkernel.calibration`` ones, including a
    submodule imported by name (``from .data import importers``)."""
    package = name.split("/")[:-1]
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[tuple[str, list[str]]] = []
        if isinstance(n, ast.ImportFrom) and n.level:
            base = package[:len(package) - n.level + 1]
            mod = ".".join(base + ([n.module] if n.module else []))
            targets.append((mod, [a.name for a in n.names]))
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("jkernel.calibration"):
            targets.append((n.module.removeprefix("jkernel.calibration").lstrip("."),
                            [a.name for a in n.names]))
        elif isinstance(n, ast.Import):
            targets += [(a.name.removeprefix("jkernel.calibration").lstrip("."), [])
                        for a in n.names if a.name.startswith("jkernel.calibration")]
        for mod, names in targets:
            subs = [s for s in (_resolve(f"{mod}.{a}".lstrip("."), known) for a in names) if s]
            whole = _resolve(mod, known)
            out.update(subs or ([whole] if whole else []))
    out.discard(name)
    return out


def test_every_module_has_a_layer():
    """The README's table names exactly the modules the package has."""
    assert set(_modules()) == set(layer_table())


def test_imports_only_go_down_the_layers():
    """Each import of a package module points to a lower layer, so the package has no import
    circle and the rooms stay apart (data never imports a fit, a fit never a report)."""
    layers = layer_table()
    mods = _modules()
    bad = []
    for name, path in mods.items():
        for dep in _imports(name, path, set(mods)):
            if layers[dep] >= layers[name]:
                bad.append(f"{name} (layer {layers[name]}) imports {dep} (layer {layers[dep]})")
    assert not bad, bad


def test_the_import_reader_sees_every_form(tmp_path):
    """The reader of imports used above finds relative, absolute and by-name submodule
    imports, at module level and inside functions (a test that cannot miss an edge)."""
    known = {"data/traces", "data/__init__", "fit/base", "fit/traces", "fit/__init__",
             "__init__"}
    src = ("from ..data.traces import StepTrace\n"
           "from . import base\n"
           "def f():\n"
           "    from jkernel.calibration.data import traces\n"
           "    import jkernel.calibration.fit.base\n")
    path = tmp_path / "probe.py"
    path.write_text(src, encoding="utf-8")
    assert _imports("fit/traces", path, known) == {"data/traces", "fit/base"}


def test_no_jax_config_at_import():
    """Importing every module leaves JAX's configuration alone (entry points set float64)."""
    names = sorted("jkernel.calibration" + ("." + m.removesuffix("/__init__").replace("/", ".")
                                            if m != "__init__" else "")
                   for m in _modules())
    code = ("import jax, importlib\n"
            f"for m in {names!r}:\n"
            "    importlib.import_module(m)\n"
            "print(jax.config.jax_enable_x64)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PKG.parents[1], check=True).stdout.strip()
    assert out == "False"
    for p in PKG.rglob("*.py"):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        for node in tree.body:          # module-level statements only
            assert "jax.config.update" not in ast.unparse(node), p.name
