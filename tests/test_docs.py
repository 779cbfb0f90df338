"""The docs match the program: example outputs, documented command lines, JSON outputs.

The example outputs of docs/cli.md (and any page of ``docs/generate.py``'s PAGES) are marked
blocks that ``python docs/generate.py`` fills; here each is compared with what the command
prints now, so a change to the program fails this file until the docs are regenerated.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import pytest

import jkernel
from jkernel import catalog as jcatalog, cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

MARKED = [(page, cmd, body) for page in generate.PAGES
          for cmd, body in generate.markers((DOCS / page).read_text())]


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv)
    return rc, out.getvalue()


def test_docs_have_marked_example_outputs():
    """The price, memory and provenance examples of docs/cli.md are generated, not typed."""
    cmds = [cmd for page, cmd, _ in MARKED if page == "cli.md"]
    assert any(c.startswith("jkernel price") for c in cmds)
    assert any(c.startswith("jkernel memory") for c in cmds)
    assert any(c.startswith("jkernel provenance") for c in cmds)


@pytest.mark.parametrize("page, cmd, body", MARKED, ids=[f"{p}: {c}" for p, c, _ in MARKED])
def test_example_output_is_what_the_program_prints(page, cmd, body):
    """Stale example outputs (the price example of docs/cli.md showed 125.312 ms expected
    while the program printed 127.574 ms). Fix: `python docs/generate.py`."""
    assert body == generate.block(cmd), f"docs/{page} is stale: run python docs/generate.py"


# -- every documented command line runs ------------------------------------------------------

def _command_lines(page: str) -> list[str]:
    lines, fence = [], None
    for line in (DOCS / page).read_text().splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
            continue
        if fence is not None and fence in ("", "sh", "bash", "console"):
            text = line.strip().removeprefix("$ ")
            if re.match(r"^([A-Z_]+=\S+ )*jkernel ", text):
                lines.append(text)
    return lines


#: Lines of a walkthrough that name files the reader writes first; they run in
#: tests/test_docs.py only through their shipped equivalents below.
_ILLUSTRATIVE = {
    "jkernel price qwen3-8b-h100-tp1.yaml --batch 32x1@4096",
    "jkernel memory qwen3-8b-h100-tp1.yaml",
    "jkernel provenance qwen3-8b-h100-tp1.yaml",
    "JKERNEL_CATALOG=my-catalog jkernel price my-scenario.yaml --batch 8x1@2048",
}

_PLACEHOLDERS = [
    ("[chips|fabrics|models|scenarios|sets] [--json]", "scenarios --json"),
    ("[chips|fabrics|models|scenarios|sets]", "scenarios"),
    ("[--out catalog/models]", ""),
    ("SCENARIO", "llama-3.1-8b-h100-tp1"),
    ("CONFIG.json", "catalog/models/qwen3-32b/config.json"),
    ("path/to/config.json", "catalog/models/qwen3-32b/config.json"),
    ("../shared/data/hf-configs/Qwen--Qwen3-8B_config.json",
     "catalog/models/qwen3-32b/config.json"),
    ("--name NAME", "--name qwen3-32b-docs"),
    ("jkernel derive config.json", "jkernel derive catalog/models/qwen3-32b/config.json"),
]

DOCUMENTED = [(page, line) for page in generate.PAGES for line in _command_lines(page)]


@pytest.mark.parametrize("page, line", DOCUMENTED, ids=[f"{p}: {l}" for p, l in DOCUMENTED])
def test_documented_command_line_runs(page, line, tmp_path, monkeypatch):
    if line in _ILLUSTRATIVE:
        pytest.skip("names a file the walkthrough has the reader write")
    monkeypatch.chdir(ROOT)
    text = line.split("  #")[0].split(" | ")[0].strip()
    for old, new in _PLACEHOLDERS:
        text = text.replace(old, new)
    argv = shlex.split(text)
    while argv and "=" in argv[0]:
        key, value = argv.pop(0).split("=", 1)
        monkeypatch.setenv(key, value)
    assert argv[0] == "jkernel"
    if "--out" in argv:
        argv[argv.index("--out") + 1] = str(tmp_path)
    rc, out = run(argv[1:])
    assert rc == 0 and out


# -- JSON outputs ----------------------------------------------------------------------------

def test_provenance_json_is_json_with_every_entry():
    """`jkernel provenance --json` printed the text table, which json.loads cannot read."""
    rc, out = run(["provenance", "llama-3.1-8b-h100-tp1", "--json"])
    assert rc == 0
    doc = json.loads(out)
    k = jkernel.open("llama-3.1-8b-h100-tp1")
    assert doc["scenario"] == "llama-3.1-8b-h100-tp1" and doc["pool"] == 0
    assert [(e["name"], e["set"], e["method"], e["scope"]) for e in doc["entries"]] == [
        (p.name, p.set, p.method, p.scope) for p in k.provenance()]
    ev, total, assumed = k.evidence()
    assert (doc["evidenced"], doc["values"], doc["assumed"]) == (ev, total, assumed)


def test_provenance_json_of_a_disaggregated_scenario_lists_every_pool():
    rc, out = run(["provenance", "llama-3.1-70b-h200-disagg", "--json"])
    doc = json.loads(out)
    assert [d["role"] for d in doc] == ["prefill", "decode"]
    assert all(isinstance(o["reason"], str) for d in doc for o in d["overrides"])


def test_catalog_json_lists_what_the_catalog_holds():
    rc, out = run(["catalog", "--json"])
    doc = json.loads(out)
    assert doc["scenarios"] == jcatalog.list_scenarios()
    assert doc["models"] == jcatalog.list_models()
    assert set(doc) == {"catalog", "registry", "chips", "fabrics", "models", "scenarios",
                        "sets"}
    rc, out = run(["catalog", "chips", "--json"])
    assert set(json.loads(out)) == {"catalog", "registry", "chips"}


# -- the API page ----------------------------------------------------------------------------

def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def test_api_page_examples_run():
    """Each Python example of docs/api.md runs, in order, in one namespace."""
    import jax

    jax.config.update("jax_enable_x64", True)
    ns: dict = {}
    blocks = _python_blocks("api.md")
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/api.md", "exec"), ns)
    assert ns["est"].expected_s > 0


def test_api_page_describes_provenance_entries_as_records():
    """docs/api.md called provenance entries tuples; they are CoefficientOrigin records."""
    text = (DOCS / "api.md").read_text()
    assert "`(name, set, method, scope)`" not in text
    p = jkernel.open("llama-3.1-8b-h100-tp1").provenance()[0]
    assert type(p).__name__ in text
    assert all(f"`{a}`" in text for a in ("name", "set", "method", "scope"))
    assert not isinstance(p, tuple)


# -- docs/calibrate.md's command lines parse ---------------------------------------------------

def _calibration_lines() -> list[str]:
    """The ``python -m calibration …`` lines of docs/calibrate.md's code blocks, with their
    backslash continuations joined."""
    out, fence, pending = [], False, ""
    for line in (DOCS / "calibrate.md").read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if pending.startswith("python -m calibration "):
                out.append(pending.strip())
            pending = ""
    return out


@pytest.mark.parametrize("line", _calibration_lines())
def test_calibrate_page_command_lines_parse(line):
    """Guards (issue 10): docs/calibrate.md showed a `traces` command line that exited 2 on
    its flags. Each documented line must parse with the calibration command's own parser
    (running the fits needs ../shared/data and is benchmarks' business)."""
    from calibration.__main__ import build_parser

    build_parser().parse_args(shlex.split(line)[3:])


def test_calibrate_page_documents_command_lines():
    assert {line.split()[3] for line in _calibration_lines()} >= {"profiles", "traces",
                                                                   "import"}
