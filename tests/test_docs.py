"""The docs match the program: example outputs, documented command lines, JSON outputs.

The example outputs of docs/cli.md (and any page of ``docs/generate.py``'s PAGES) are marked
blocks that ``python docs/generate.py`` fills; here each is compared with what the command
prints now, so a change to the program fails this file until the docs are regenerated.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pandas as pd
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
    ("replay SCENARIO --requests FILE",
     "replay qwen3-14b-h100-tp1 --requests tests/data/residency-vllm/agg_2rps_head.csv"),
    ("plan MODEL --chip CHIP --gpus N --isl N --osl N --rate R",      # a small search
     "plan qwen3-0.6b --chip h100 --gpus 1 --isl 256 --osl 16 --rate 1 --requests 20 "
     "--replay-top 1 --workers 1"),
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
        pytest.skip("names a file the walkthrough has the reader write: runs in "
                    "test_add_model_walkthrough_runs")
    monkeypatch.chdir(ROOT)
    text = line.split("  #")[0].split(" | ")[0].strip()
    for old, new in _PLACEHOLDERS:
        text = text.replace(old, new)
    argv = shlex.split(text)
    while argv and "=" in argv[0]:
        key, value = argv.pop(0).split("=", 1)
        monkeypatch.setenv(key, value)
    assert argv[0] == "jkernel"
    if "--out" in argv:                  # a folder, or a file (`replay --out latencies.csv`)
        i = argv.index("--out") + 1
        argv[i] = str(tmp_path / Path(argv[i]).name) if Path(argv[i]).suffix else str(tmp_path)
    rc, out = run(argv[1:])
    assert rc == 0 and out


def test_add_model_walkthrough_runs(tmp_path, monkeypatch):
    """docs/add-model.md end to end, in a scratch folder: copy the shipped catalog (§4),
    derive a Qwen3 config into it (the Qwen3-8B config of the shared data, or on a clone
    without it the shipped Qwen3-14B config under the page's name), check the three files
    of §1's table, write §3's bundle as the page shows it, and run every command line that
    names the reader's files (the lines test_documented_command_line_runs skips)."""
    import shutil

    text = (DOCS / "add-model.md").read_text()
    catalog = tmp_path / "my-catalog"
    shutil.copytree(jcatalog.shipped_root(), catalog)
    shutil.rmtree(catalog / "models/qwen3-8b", ignore_errors=True)   # the catalog ships one
    config = ROOT / "../shared/data/hf-configs/Qwen--Qwen3-8B_config.json"
    if not config.exists():
        config = ROOT / "catalog/models/qwen3-14b/config.json"
    rc, _ = run(["derive", str(config), "--name", "qwen3-8b", "--out", str(catalog / "models")])
    assert rc == 0
    table = text[text.index("| File | What |"):].split("\n\n")[0]
    files = re.findall(r"^\| `([\w.]+)` \|", table, re.M)
    assert sorted(files) == sorted(p.name for p in (catalog / "models/qwen3-8b").iterdir())
    (bundle,) = re.findall(r"```yaml\n(.*?)```", text, re.S)
    (tmp_path / "qwen3-8b-h100-tp1.yaml").write_text(bundle)
    (tmp_path / "my-scenario.yaml").write_text(bundle)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JKERNEL_CATALOG", str(catalog))     # §3 derives into the catalog
    ran = []
    for line in _ILLUSTRATIVE:
        argv = shlex.split(line)
        while "=" in argv[0]:
            key, value = argv.pop(0).split("=", 1)
            monkeypatch.setenv(key, str(tmp_path / value))
        rc, out = run(argv[1:])
        assert rc == 0 and out.startswith("qwen3-8b-h100-tp1"), line
        ran.append(line)
    assert set(ran) == {line for page, line in DOCUMENTED if line in _ILLUSTRATIVE}


def _subcommands() -> dict:
    import argparse

    (sub,) = [a for a in cli.build_parser()._actions
              if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def test_cli_page_lists_every_subcommand_and_price_option():
    """docs/cli.md said the command had five subcommands (it has seven: replay and plan were
    missing) and its price option table left out `--breakdown`."""
    text = (DOCS / "cli.md").read_text()
    subs = _subcommands()
    words = {5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine"}
    assert f"It has {words[len(subs)]} subcommands" in text
    overview = re.search(r"subcommands:\n\n```\n(.*?)```", text, re.S)[1]
    assert [line.split()[1] for line in overview.splitlines()] == list(subs)
    for name in subs:
        assert f"`jkernel {name}`" in text, name
    table = text[text.index("| Option | Meaning |"):].split("\n\n")[0]
    documented = set(re.findall(r"^\| `(--[\w-]+)", table, re.M))
    options = {o for a in subs["price"]._actions for o in a.option_strings} - {"-h", "--help"}
    assert documented == options


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


def test_bulk_page_first_example_runs_scaled_down():
    """docs/bulk.md's first example, with 1,000 batches in place of its 1,000,000 (the same
    code otherwise): the result has one figure per batch, as its comment says; and its
    stated checks hold (zero batches give empty arrays, a fractional count raises
    jkernel.ArgumentError naming the argument)."""
    import jax

    jax.config.update("jax_enable_x64", True)
    code = _python_blocks("bulk.md")[0]
    assert code.count("1_000_000") == 2 and "(1000000,)" in code
    ns: dict = {}
    exec(compile(code.replace("1_000_000", "1_000"), "docs/bulk.md", "exec"), ns)
    assert ns["est"].expected_s.shape == (1000,)
    assert ns["est"].expected_s.dtype == np.float64
    k = ns["k"]
    empty = k.price_many(scheduled=np.zeros((0, 4), np.int32),
                         computed=np.zeros((0, 4), np.int32))
    assert empty.expected_s.shape == (0,)
    with pytest.raises(jkernel.ArgumentError, match="scheduled"):
        k.price_many(scheduled=np.full((1, 2), 1.5), computed=np.zeros((1, 2)))


# -- docs/calibrate.md's command lines parse ---------------------------------------------------

def _calibration_lines() -> list[str]:
    """The ``python -m jkernel.calibration …`` lines of docs/calibrate.md's code blocks, with
    their backslash continuations joined."""
    out, fence, pending = [], False, ""
    for line in (DOCS / "calibrate.md").read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            continue
        pending += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if pending.startswith("python -m jkernel.calibration "):
                out.append(pending.strip())
            pending = ""
    return out


@pytest.mark.parametrize("line", _calibration_lines())
def test_calibrate_page_command_lines_parse(line):
    """Guards: docs/calibrate.md showed a `traces` command line that exited 2 on
    its flags. Each documented line must parse with the calibration command's own parser
    (running the fits needs ../shared/data and is benchmarks' business)."""
    from jkernel.calibration.__main__ import build_parser

    build_parser().parse_args(shlex.split(line)[3:])


def test_calibrate_page_documents_command_lines():
    assert {line.split()[3] for line in _calibration_lines()} >= {"profiles", "traces",
                                                                   "import"}


# -- table regions (docs/simulator.md's validation table) --------------------------------------

TABLES = [(page, cmd, body) for page in generate.PAGES
          for cmd, body in generate.tables((DOCS / page).read_text())]


def test_calibrate_page_has_the_generated_step_fit_figures():
    cmds = [cmd for page, cmd, _ in TABLES if page == "calibrate.md"]
    assert "python -m validation.stepreport ../shared/data/residency-vllm --markdown" in cmds
    from jkernel.calibration.fit.stepfit import COLLINEAR

    assert f"(R² > {COLLINEAR})" in (DOCS / "calibrate.md").read_text()


def test_simulator_page_has_the_generated_validation_table():
    cmds = [cmd for page, cmd, _ in TABLES if page == "simulator.md"]
    assert any(c.startswith("python -m validation.replay ") and "--markdown" in c
               and "--constants both" in c for c in cmds)


@pytest.mark.slow
@pytest.mark.parametrize("page, cmd, body", TABLES, ids=[f"{p}: {c}" for p, c, _ in TABLES])
def test_table_region_is_what_the_program_prints(page, cmd, body):
    """docs/simulator.md's validation table said it was measured on a trial merge of old
    branches and no longer matched the shipped constants (compute_derate 0.918973). Now it
    is the output of the command its marker names, compared here with what the command
    prints (the five residency-vllm replays, twice: about 30 s). Fix: docs/generate.py."""
    missing = generate.missing_inputs(cmd)
    if missing:
        pytest.skip(f"{', '.join(missing)} is absent (a clone without the shared data): the "
                    "figures are checked only where the measured runs are; the region's "
                    "format is checked on the committed excerpts by "
                    "test_validation_table_format_on_the_committed_excerpt and "
                    "test_step_fit_figures_format_on_the_committed_excerpt")
    assert body == generate.region(cmd), f"docs/{page} is stale: run python docs/generate.py"


def _masked(text: str) -> list[str]:
    """``text``'s lines with every number (signed, with decimals or thousands commas)
    replaced by N: what is left is the table's shape and wording."""
    return [re.sub(r"[−+-]?\d[\d,]*(?:\.\d+)?", "N", line) for line in text.splitlines()]


def test_validation_table_format_on_the_committed_excerpt(tmp_path, capsys):
    """Runs on a fresh clone: the validation command, with the doc's flags, on a residency
    folder whose five runs are each 20 requests of the committed excerpt
    (tests/data/residency-vllm/agg_2rps_head.csv), prints a table of the doc's shape: the
    same header, the same halves, the same run labels in the same order, the same cells
    and closing sentence up to the figures."""
    from validation import replay as V

    (page, cmd, body), = [t for t in TABLES if t[1].startswith("python -m validation.replay")]
    argv = shlex.split(cmd)[3:]
    root = Path(argv[0])
    assert root == Path("../shared/data/residency-vllm")       # what the runs' folders hang off
    head = (ROOT / "tests/data/residency-vllm/agg_2rps_head.csv").read_text()
    runs = pd.read_csv(ROOT / "tests/data/residency-vllm/runs.csv").set_index("run")
    for name, folder in V.RUNS:
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "trace.csv").write_text(
            "".join(head.splitlines(keepends=True)[:21]))
        # the run's measured ITL percentiles, as its summary.json gives them (ms)
        itl = {f"p{q}": runs.loc[name, f"itl_p{q}"] * 1e3 for q in (50, 90, 99)}
        (tmp_path / folder / "summary.json").write_text(json.dumps({"overall": {"itl_ms": itl}}))
    capsys.readouterr()
    assert V.main([str(tmp_path), *argv[1:]]) == 0
    out = capsys.readouterr().out
    assert _masked(out) == _masked(body)
    rows = [line for line in body.splitlines() if line.startswith("| ") and "%" in line]
    assert [r.split(" | ")[0].removeprefix("| ") for r in rows] == [V.LABELS[n] for n, _ in V.RUNS]


def test_step_fit_figures_format_on_the_committed_excerpt(capsys):
    """Runs on a fresh clone: docs/calibrate.md's step-fit command on the committed excerpt
    of the 2 req/s run (tests/data/residency/, 300 requests), fitted on its first 70 % and
    held out whole as the "second run", prints the doc's region up to the figures: the
    residual and R² sentences, the table's header and its four rows in order. (docs/calibrate.md
    showed "+2 ns per prefill token" for a residual of about 2 µs, and profile-only prefill
    errors of 0.092 and 0.125 where the program gave 0.091 and 0.123.)"""
    from validation import stepreport

    (page, cmd, body), = [t for t in TABLES if t[1].startswith("python -m validation.step")]
    argv = shlex.split(cmd)[3:]
    assert argv[0] == "../shared/data/residency-vllm"
    capsys.readouterr()
    assert stepreport.main([str(ROOT / "tests/data/residency"), "--runs", "agg_2rps",
                            "agg_2rps", *argv[1:]]) == 0
    out = capsys.readouterr().out
    assert _masked(out) == _masked(body)
    assert [r.split(" | ")[0] for r in body.splitlines() if r.startswith("| ") and "µs" in r] \
        == ["| last 30 %, profiles only", "| last 30 %, fitted", "| second run, profiles only",
            "| second run, fitted"]


# -- docs/simulator.md's other tables and names --------------------------------------------

def _simulator() -> str:
    return (DOCS / "simulator.md").read_text()


def _shape_rows() -> dict[str, list[str]]:
    """The `--requests` shapes table: shape → the backticked column names of its row."""
    text = _simulator()
    table = text[text.index("| shape | columns |"):].split("\n\n")[0]
    return {row.split(" | ")[0].removeprefix("| "):
            [c.strip() for span in re.findall(r"`([^`]+)`", row.split(" | ")[1])
             for c in span.split(",")]
            for row in table.splitlines()[2:]}


def test_request_shapes_table_is_what_load_requests_accepts(tmp_path):
    """Each shape of the `--requests` table loads with exactly the columns it names, and
    loses a named column only with an error naming it."""
    from jkernel.replay import load_requests

    shapes = _shape_rows()
    assert len(shapes) == 3
    values = {"request_id": [0, 1], "arrival_time_us": [0, 500_000], "arrival_s": [0.0, 0.5],
              "input_tokens": [100, 200], "output_tokens": [4, 8]}
    for shape in ("the replay's own", "seconds"):
        cols = shapes[shape]
        path = tmp_path / f"{len(cols)}-{cols[1]}.csv"
        pd.DataFrame({c: values[c] for c in cols}).to_csv(path, index=False)
        got = load_requests(path)
        assert got["arrival_s"].tolist() == [0.0, 0.5] and len(got) == 2
        for c in cols:
            short = tmp_path / f"without-{c}.csv"
            pd.DataFrame({d: values[d] for d in cols if d != c}).to_csv(short, index=False)
            with pytest.raises(ValueError, match=c if c != "arrival_time_us" else "arrival"):
                load_requests(short)
    (client,) = [k for k in shapes if k not in ("the replay's own", "seconds")]
    trace_file = ROOT / "tests/data/residency-vllm/agg_2rps_head.csv"
    raw = pd.read_csv(trace_file)
    got = load_requests(trace_file)
    assert set(shapes[client]) <= set(raw.columns)
    sent = raw.set_index("request_id")["send_time_us"]
    assert np.allclose(got.set_index("request_id")["arrival_s"],
                       (sent - sent.min()).loc[got["request_id"]].to_numpy() / 1e6)
    assert (got.set_index("request_id")["input_tokens"]
            == raw.set_index("request_id")["server_input_tokens"].loc[got["request_id"]]).all()


@pytest.fixture(scope="module")
def small_replay():
    from jkernel.replay import load_requests, replay

    reqs = load_requests(ROOT / "tests/data/residency-vllm/agg_2rps_head.csv").head(12)
    return reqs, replay(jkernel.open("qwen3-14b-h100-tp1"), reqs)


def test_out_columns_and_summary_keys_are_the_replays(small_replay):
    """The `--out` column list of docs/simulator.md is the replay table's first columns (the
    rest are the input's), and the `res.summary` comment names its keys."""
    reqs, res = small_replay
    text = _simulator()
    listed = text[text.index("`--out` writes one row per request"):].split("and every input")[0]
    cols = re.findall(r"`?(\w+)[,`]", listed.split("`.parquet`):", 1)[1])
    assert list(res.requests.columns[:len(cols)]) == cols
    assert set(res.requests.columns[len(cols):]) <= set(reqs.columns)
    comment = re.search(r"res\.summary\s+#(.*?)res\.steps", text, re.S)[1]
    names = set()
    for word in re.findall(r"[\w/]+", comment.replace("#", " ")):
        if "/" in word:                                       # ttft/itl/e2e _mean/_p50… _s
            continue
        names.add(word)
    stats = {f"{m}_{s}_s" for m in ("ttft", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")}
    assert "ttft/itl/e2e _mean/_p50/_p90/_p99 _s" in " ".join(comment.split())
    assert stats <= set(res.summary)
    assert names - {"_s"} <= set(res.summary)
    assert set(res.summary) - stats <= names


def test_simulator_page_names_real_settings_and_methods():
    """The `k.settings` keys and the kernel methods docs/simulator.md tells a simulator to
    read exist under those names."""
    text = _simulator()
    k = jkernel.open("qwen3-14b-h100-tp1")
    keys = set(re.findall(r"\bsettings\.(\w+)", text))
    for m in re.finditer(r"`(?:k|kernel)\.settings`[^(]*\(([^)]*)\)", text):
        keys |= set(re.findall(r"`(\w+)`", m[1]))
    assert {"block_size", "max_num_batched_tokens", "max_num_seqs", "engines",
            "decode_threshold"} <= keys
    assert keys <= set(k.settings.as_dict())
    methods = set(re.findall(r"`(?:k|kernel|prefill|jkernel\.Kernel)\.(\w+)\(", text))
    methods |= set(re.findall(r"`(\w+_overhead|tier_time|pd_transfer_time)\(", text))
    methods |= set(re.findall(r"\b(?:k|kernel|prefill)\.(\w+)\(", text))
    assert {"kv_cache_pages", "step_time", "admission_overhead", "pd_transfer_time"} <= methods
    for name in methods:
        assert callable(getattr(k, name, None)), name
    assert callable(k.resolution().data_parallel)


def test_simulator_page_speed_run_is_the_8_rps_run():
    """The Speed section's run is the measured 8 requests/s run, by its request count."""
    runs = pd.read_csv(ROOT / "tests/data/residency-vllm/runs.csv").set_index("run")
    n = int(runs.loc["8rps", "requests"])
    assert f"the 8 requests/s run ({n:,} requests" in " ".join(_simulator().split())


def test_simulator_page_python_example_runs(monkeypatch):
    """docs/simulator.md's Python example (it read a `trace.csv` that was not there and used
    an undefined `requests`) runs as written from the repository root."""
    import jax

    jax.config.update("jax_enable_x64", True)
    monkeypatch.chdir(ROOT)
    code = _python_blocks("simulator.md")[0]
    ns: dict = {}
    exec(compile(code, "docs/simulator.md", "exec"), ns)
    assert ns["res"].summary["completed"] == len(ns["requests"])


def test_simulator_page_pricer_example_runs():
    """docs/simulator.md's pricer example runs as written and its clock is the sum of the
    steps' ``step_time(...).expected_s`` at the settings' decode threshold."""
    import jax

    jax.config.update("jax_enable_x64", True)
    blocks = _python_blocks("simulator.md")
    assert len(blocks) == 2
    ns: dict = {}
    exec(compile(blocks[1], "docs/simulator.md", "exec"), ns)
    k = ns["k"]
    want = 0.0
    for s, c, pad in ns["steps"]:
        want += k.step_time(jkernel.Batch(s, c, decode_threshold=k.settings.decode_threshold,
                                          pad_tokens=pad)).expected_s
    assert ns["clock_s"] == want > 0


# -- docs/calibrate.md's step-trace example runs ---------------------------------------------

_EXCERPT = "tests/data/residency/agg_2rps"
_SHARED_RUNS = ("../shared/data/residency-vllm/sweep_rate/agg_2rps",
                "../shared/data/residency-vllm/sweep_tenants/1T_agg_2rps")


def test_calibrate_page_trace_example_writes_entries(tmp_path, monkeypatch, capsys):
    """Guards: docs/calibrate.md's `traces` example wrote no entries. Its three
    command lines run here as written, on the committed 300-request excerpt of the 2 req/s
    run (tests/data/residency/) in place of both shared runs, with build/ in a scratch
    folder; the fit writes the three step constants as fitted h100 entries."""
    from jkernel.calibration.__main__ import main as calibrate
    from jkernel.documents.coefficients import load_coefficient_set

    lines = [line for line in _calibration_lines()
             if line.split()[3] == "import" or line.split()[3] == "traces"
             and "--traces build/" in line]
    assert [line.split()[3] for line in lines] == ["import", "import", "traces"]
    monkeypatch.chdir(ROOT)
    for line in lines:
        for shared in _SHARED_RUNS:
            line = line.replace(shared, _EXCERPT)
        line = line.replace("build/", f"{tmp_path}/")
        assert calibrate(shlex.split(line)[3:]) == 0, line
    err = capsys.readouterr().err
    assert "wrote 3 entries" in err
    cs = load_coefficient_set(tmp_path / "vllm-h100-steps.yaml")
    got = {e.name: e for e in cs.entries}
    assert set(got) == {"host_serial", "host_serial_per_request", "compute_derate"}
    assert all(e.method == "fitted" for e in got.values())
    assert (tmp_path / "heldout.csv").stat().st_size > 0


def test_calibrate_page_fitted_figures_are_the_catalogs():
    """The "fitted" rows of docs/calibrate.md's held-out table are the figures the shipped
    step-trace entries record (their rationale, written by jkernel.calibration.regenerate
    --steps):
    decode and prefill median |log ratio| and the decode slope against the measured one."""
    text = (DOCS / "calibrate.md").read_text()
    k = jkernel.open("qwen3-14b-h100-tp1")
    (origin,) = [p for p in k.provenance() if p.name == "compute_derate"]
    from jkernel.documents.coefficients import load_coefficient_set

    cs = load_coefficient_set(ROOT / "catalog/coefficients" / f"{origin.set}.yaml")
    version = k.inputs.scenario.engine_version
    (entry,) = [e for e in cs.entries if e.name == "compute_derate"
                and "h100" in (e.scope.hardware or ())
                and (e.scope.engine_version is None or e.scope.engine_version.contains(version))]
    rec = re.findall(r"decode ([\d.]+), prefill ([\d.]+), decode slope ([\d.]+)× measured",
                     " ".join(entry.rationale.split()))
    assert len(rec) == 2                                   # last 30 %, second run
    rows = re.findall(r"\| (last 30 %|second run), fitted \| \*\*([\d.]+)\*\* \| "
                      r"\*\*([\d.]+)\*\* \| \*\*([\d.]+) µs\*\* \(([\d.]+)\) \|", text)
    assert len(rows) == 2
    for (dec, pre, slope), (_, d, p, pred, meas) in zip(rec, rows):
        assert (d, p) == (dec, pre)
        assert float(pred) / float(meas) == pytest.approx(float(slope), abs=6e-4)


# -- docs/api.md's signatures, names and constants are the program's ---------------------------

def _doc_params(sig: str) -> list[tuple[str, str | None, bool]]:
    """``a, b=None, *, c=1`` → [(name, default text or None, keyword-only)]; ``...`` after a
    name stands for its default (not checked), a trailing ``...`` for further arguments."""
    out, kwonly = [], False
    for part in (p.strip() for p in sig.split(",")):
        if part == "*":
            kwonly = True
        elif part and part != "...":
            name, _, default = part.partition("=")
            out.append((name.strip(), default.strip() or None, kwonly))
    return out


def _check_signature(doc_sig: str, fn, *, complete: bool = True) -> None:
    import inspect

    sig = inspect.signature(fn)
    actual = [p for p in sig.parameters.values() if p.name != "self"]
    documented = _doc_params(doc_sig)
    names = [p.name for p in actual]
    if complete:
        assert [d[0] for d in documented] == names, (doc_sig, names)
    for name, default, kwonly in documented:
        assert name in names, (doc_sig, name, names)
        p = sig.parameters[name]
        if name == "kw":
            continue
        assert (p.kind is inspect.Parameter.KEYWORD_ONLY) == kwonly, (doc_sig, name)
        if default not in (None, "..."):
            assert p.default is not inspect.Parameter.empty, (doc_sig, name)
            assert ast.literal_eval(default) == p.default, (doc_sig, name, p.default)


def test_api_page_signatures_are_the_programs():
    """Each signature docs/api.md writes out names the function's parameters, in order, with
    the defaults it states (`price_sweep`'s first parameter was documented as `params_list`,
    the program calls it `params`)."""
    text = (DOCS / "api.md").read_text()
    k = jkernel.open("llama-3.1-8b-h100-tp1")
    calls = {"jkernel.open": jkernel.open, "jkernel.open_pool": jkernel.open_pool,
             "jkernel.open_inputs": jkernel.open_inputs, "jkernel.Repos": jkernel.Repos,
             "jkernel.Batch": jkernel.Batch, "jkernel.Placement": jkernel.Placement,
             "k.price_many": k.price_many, "k.price_sweep": k.price_sweep,
             "k.tier_time": k.tier_time, "k.pd_transfer_time": k.pd_transfer_time,
             "k.admission_overhead": k.admission_overhead,
             "k.admission_overheads": k.admission_overheads,
             "k.sequence_variable_bytes": k.sequence_variable_bytes}
    seen = set()
    for name, fn in calls.items():
        for m in re.finditer(re.escape(name) + r"\(([^)`]*)\)", text):
            sig = m[1].replace("**kw", "kw")
            if not sig.strip() or sig.strip().startswith(("\"", "[")):
                continue                                   # a call, not a signature
            _check_signature(sig, fn, complete=not sig.rstrip().endswith("..."))
            seen.add(name)
    assert {"jkernel.open", "jkernel.Batch", "k.price_many", "k.price_sweep",
            "jkernel.Repos", "k.tier_time"} <= seen
    assert re.search(r"`buckets=\(([^)]*)\)`", text)[1] == ", ".join(
        str(b) for b in __import__("inspect").signature(jkernel.Kernel).parameters[
            "buckets"].default)


def test_api_page_names_and_constants_are_the_programs():
    """The fields, methods, settings keys and constants docs/api.md lists exist as written,
    and its first example's comment names the bottleneck the program reports."""
    text = (DOCS / "api.md").read_text()
    k = jkernel.open("llama-3.1-70b-h100-tp4")
    est = k.step_time(jkernel.Batch.from_spec("32x1@4096,1x2048@0"))
    assert re.search(r"est\.bottleneck_name\s+# seconds, seconds, \"(\w+)\"", text)[1] \
        == est.bottleneck_name
    fields = text[text.index("| Field | Meaning |"):].split("\n\n")[0]
    for f in re.findall(r"^\| `(\w+)` \|", fields, re.M):
        assert hasattr(est, f), f
    assert set(re.search(r"`per_resource_s` \| `\{([^}]*)\}`", text)[1].replace('"', "")
               .replace(" ", "").split(",")) == set(est.per_resource_s.keys())
    for owner, obj in (("k", k), ("p", k.params), ("est", est)):
        for name in set(re.findall(rf"`{owner}\.(\w+)\(", text)):
            assert callable(getattr(obj, name, None)), f"{owner}.{name}"
        for name in set(re.findall(rf"`{owner}\.(\w+)`", text)):
            assert hasattr(obj, name), f"{owner}.{name}"
    listed = re.search(r"`k\.settings` \| [^:]*: ([^|]*)\|", text)[1]
    assert set(re.findall(r"`(\w+)`", listed)) <= set(k.settings.as_dict())
    consts = text[text.index("## Constants"):]
    for name, value in re.findall(r"`jkernel\.(\w+) = ([^`]+)`", consts):
        assert getattr(jkernel, name) == eval(value), name
    assert "default 4,096" in (DOCS / "bulk.md").read_text()
    assert __import__("inspect").signature(k.price_many).parameters["chunk"].default == 4096
