"""The package's shape: no import circle among its modules, and no module that sets
``jax.config`` when imported (entry points set it, never an import)."""

from __future__ import annotations

import ast

import pytest

from conftest import ROOT

PACKAGES = ["jkernel", "validation"]


def _modules(package: str) -> dict[str, ast.Module]:
    root = ROOT / package
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = ast.parse(path.read_text(), str(path))
    return out


def _top_level_imports(name: str, tree: ast.Module, known: set[str], is_pkg: bool) -> set[str]:
    """Modules of the package imported by the module body (not inside functions, not under
    ``if TYPE_CHECKING``)."""
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    pkg = base[:len(base) - node.level + 1]
                    mod = ".".join(pkg + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod in known:
                    out.add(mod)
                for a in node.names:
                    sub = f"{mod}.{a.name}"
                    if sub in known:
                        out.add(sub)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, field, []) or [])

    visit(tree.body)
    out.discard(name)
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package):
    mods = _modules(package)
    known = set(mods)
    pkgs = {m for m in mods if (ROOT / m.replace(".", "/") / "__init__.py").is_file()}
    graph = {m: _top_level_imports(m, t, known, m in pkgs) for m, t in mods.items()}
    # a package's __init__ importing its own submodules is not a circle of concern; drop
    # edges from a submodule back to the package that contains it
    for m in graph:
        graph[m] = {d for d in graph[m] if not (d in pkgs and m.startswith(d + "."))}
    cycles = _cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" → ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                dfs(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    return cycles


def test_the_circle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    tree = ast.parse("from . import b\nfrom .c import x\ndef f():\n    from . import d\n")
    assert _top_level_imports("p.a", tree, {"p.b", "p.c", "p.d"}, False) == {"p.b", "p.c"}


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_level_jax_config(package):
    """``jax.config`` is set by entry points (functions), never when a module is imported."""
    found = []
    for name, tree in _modules(package).items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, ast.Attribute) and ast.unparse(sub).startswith("jax.config"):
                    found.append(f"{name}:{node.lineno}")
                    break
    assert not found, f"module-level jax.config in {found}"


def test_every_subpackage_is_installed():
    """pyproject's setuptools package list names every package directory, so a
    non-editable install (CI's, a user's) carries it: jkernel.replay was once left out."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)


#: Private names a module may read on objects it does not define: NamedTuple's own API, and
#: the one probe of JAX's private state (runtime.py, which guards it and falls back).
_PRIVATE_ALLOWED = {"_fields", "_replace", "_asdict", "_make", "_backends"}


def _private_reads(path: Path) -> list[str]:
    """``x._name`` reads (``x`` not ``self``/``cls``) of a private attribute the module
    itself never defines, and ``from m import _name`` imports, in one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            own.add(n.attr)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            own.add(n.value)                                  # __slots__ entries
    bad = []
    for n in ast.walk(tree):
        if (isinstance(n, ast.Attribute) and n.attr.startswith("_")
                and not n.attr.startswith("__") and ast.unparse(n.value) not in ("self", "cls")
                and n.attr not in own and n.attr not in _PRIVATE_ALLOWED):
            bad.append(f"{path.relative_to(ROOT)}:{n.lineno}: {ast.unparse(n)}")
        if isinstance(n, ast.ImportFrom):
            bad += [f"{path.relative_to(ROOT)}:{n.lineno}: from {n.module} import {a.name}"
                    for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def test_no_module_reads_another_modules_private_names():
    """Values cross module boundaries through public names: no module of jkernel reads a
    private attribute it does not define itself, or imports a private name (the replay once
    read the kernel's private resolved settings, and the bench the kernel's programs)."""
    bad = [hit for p in sorted((ROOT / "jkernel").rglob("*.py")) for hit in _private_reads(p)]
    assert not bad, bad
