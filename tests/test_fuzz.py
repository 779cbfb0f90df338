"""Fuzzing what a user types: documents, request tables, batch arrays and command lines.

Each property holds for any input hypothesis draws: **a clear error naming the input, or a
finite, monotone answer** — never a raw traceback (TypeError, IndexError, OverflowError,
KeyError …), never NaN, never a hang. A clear error is a :class:`jkernel.Refusal` naming
the file, an :class:`jkernel.ArgumentError` naming the argument, or a ``ValueError`` whose
message starts with the request file; on the command line, exit status 2 and one
``jkernel: …`` line.

Bounded in time: few examples each, derandomized (the same inputs every run), no deadline
(a first call compiles, and a loaded machine is slow: time is measured in ``benchmarks/``, not
asserted here), one compiled step program (a single request bucket), so the file costs
seconds of CPU (docs/limits.md lists the limits these inputs run into).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import jkernel
from jkernel import ArgumentError, Batch, Refusal, cli
from jkernel.documents import parse_bundle, parse_graph
from jkernel.documents._strict import load_yaml_documents
from jkernel.replay import validate_requests

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = "llama-3.1-8b-h100-tp1"
BUNDLE = ROOT / "catalog" / "scenarios" / f"{SCENARIO}.yaml"
GRAPH = ROOT / "catalog" / "models" / "llama-3.1-8b-instruct" / "graph.yaml"
SLACK = 1 - 1e-12

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

# -- values a user might type -------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-3, 3), st.integers(-2 ** 70, 2 ** 70),
    st.sampled_from([0, 1, 2 ** 31, 2 ** 63, 10 ** 30, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 1e9, -0.0, 1e300]),
    st.text(max_size=8), st.sampled_from(["", "auto", "fp8", "0", "1e9", "nan", "../x"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=6)


def paths(doc, prefix=()):
    """Every (path, value) of a nested document."""
    yield prefix, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, prefix + (i,))


def mutated(doc, data):
    """``doc`` with one value replaced, one key removed or one unknown key added."""
    doc = copy.deepcopy(doc)
    spots = [p for p, v in paths(doc) if p]
    path = data.draw(st.sampled_from(spots))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    action = data.draw(st.sampled_from(["replace", "replace", "drop", "add"]))
    if action == "replace":
        parent[path[-1]] = data.draw(values)
    elif action == "drop":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[data.draw(st.text(min_size=1, max_size=6))] = data.draw(values)
    return doc


# -- documents ------------------------------------------------------------------------------------

YAML_BITS = st.sampled_from(["a", "b", ":", " ", "\n", "- ", "[", "]", "{", "}", ",", "&x ",
                             "*x", "&y ", "*y", "!!", "'", '"', "#", "1", "1e9", "---\n",
                             "? ", "|", "<<: ", "\t", "\x00", "é"])


@FUZZ
@given(st.lists(YAML_BITS, max_size=40).map("".join))
def test_any_yaml_text_loads_or_is_refused_naming_the_file(text):
    try:
        load_yaml_documents(text, "fuzz.yaml")
    except Refusal as exc:
        assert exc.file == "fuzz.yaml" and exc.code == "R1"


@FUZZ
@given(st.integers(1, 12), st.integers(1, 12))
def test_aliases_of_any_fan_out_load_or_are_refused_at_once(fan, depth):
    lines = [f"l0: &l0 [{', '.join(['x'] * fan)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan)}]" for i in range(1, depth)]
    try:
        load_yaml_documents("\n".join(lines), "fan.yaml")
    except Refusal as exc:
        assert exc.file == "fan.yaml"
        assert "aliases are expanded" in str(exc) or "nesting deeper" in str(exc)
    else:
        assert fan ** depth <= jkernel.limits.MAX_YAML_NODES


def _clean_refusal(exc: Refusal, file: str) -> None:
    assert exc.file == file and exc.code.startswith("R") and exc.reason


@FUZZ
@given(st.data())
def test_any_one_change_to_a_bundle_parses_or_is_refused_naming_the_file(data):
    docs = list(yaml.safe_load_all(BUNDLE.read_text()))
    changed = mutated(docs, data)
    try:
        parse_bundle(changed, "b.yaml")
    except Refusal as exc:
        _clean_refusal(exc, "b.yaml")


@FUZZ
@given(st.data())
def test_any_one_change_to_a_graph_parses_or_is_refused_naming_the_file(data):
    doc = yaml.safe_load(GRAPH.read_text())
    try:
        g = parse_graph(mutated(doc, data), "g.yaml")
    except Refusal as exc:
        _clean_refusal(exc, "g.yaml")
    else:
        assert 1 <= g.total_layers <= jkernel.limits.MAX_LAYERS


@FUZZ
@given(st.data())
def test_any_one_change_to_a_config_derives_or_is_refused(data):
    from jkernel.derive import derive_graph

    cfg = json.loads((GRAPH.parent / "config.json").read_text())
    try:
        doc = derive_graph(mutated(cfg, data), name="m", sha256="0" * 64)
    except Refusal as exc:
        assert exc.code == "R1" and exc.reason
    else:
        assert parse_graph(doc).total_layers <= jkernel.limits.MAX_LAYERS


# -- request tables ---------------------------------------------------------------------------------

COLUMNS = ["request_id", "arrival_s", "arrival_time_us", "input_tokens", "output_tokens",
           "prefix_group", "prefix_length", "block_hashes"]
cells = st.one_of(st.none(), st.integers(-5, 5000), st.integers(-2 ** 62, 2 ** 62),
                  st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(
                      ["", "g", "1 2", "x", "1e3", "-1"]))


@st.composite
def request_tables(draw):
    n = draw(st.integers(0, 6))
    base = {"request_id": list(range(n)), "arrival_s": [0.25 * i for i in range(n)],
            "input_tokens": [64] * n, "output_tokens": [3] * n}
    for col in draw(st.lists(st.sampled_from(COLUMNS), max_size=3, unique=True)):
        if draw(st.booleans()) and col in base:
            del base[col]
        else:
            base[col] = draw(st.lists(cells, min_size=n, max_size=n))
    return pd.DataFrame(base)


@FUZZ
@given(request_tables())
def test_any_request_table_is_validated_or_refused_naming_the_source(df):
    try:
        got = validate_requests(df, source="r.csv")
    except ValueError as exc:
        assert str(exc).startswith("r.csv: "), exc
        return
    arrival = got["arrival_s"].to_numpy()
    assert np.isfinite(arrival).all() and (np.diff(arrival) >= 0).all()
    assert (arrival >= 0).all() and (arrival <= jkernel.limits.MAX_ARRIVAL_S).all()
    for col in ("input_tokens", "output_tokens"):
        x = got[col].to_numpy()
        assert x.dtype.kind == "i" and (x >= 1).all() and (x <= jkernel.limits.INT32_MAX).all()
    if "prefix_length" in got and len(got):
        named = got["prefix_group"].notna() & (got["prefix_group"].astype(str) != "")
        assert (got.loc[named, "prefix_length"].astype(float)
                <= got.loc[named, "input_tokens"]).all()


# -- batch arrays -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kernel():
    k = jkernel.open(SCENARIO, buckets=(16,))      # one bucket: one compiled program
    k.warm_up()
    for dtype in (None, np.float32):               # and the bulk program of (4, 16) arrays
        k.price_many(scheduled=np.ones((4, 16), np.int32), dtype=dtype)
    return k


token = st.one_of(st.integers(0, 4096), st.integers(-3, 3), st.sampled_from(
    [2 ** 31, 2 ** 40, -2 ** 31]), st.floats(allow_nan=True, allow_infinity=True))


@FUZZ
@given(st.lists(st.tuples(token, token), min_size=0, max_size=16), st.data())
def test_any_batch_prices_finite_and_monotone_or_names_the_argument(kernel, rows, data):
    sched = [r[0] for r in rows]
    comp = [r[1] for r in rows]
    try:
        b = Batch(sched, comp)
    except ArgumentError as exc:
        assert exc.argument in ("scheduled", "computed") and str(exc).startswith(exc.argument)
        return
    est = kernel.step_time(b)
    figures = [est.expected_s, est.overlap_s, est.no_overlap_s, *est.per_resource_s.values()]
    assert all(math.isfinite(x) and x >= 0 for x in figures)
    if len(b) and b.tokens() < 2 ** 30:
        i = data.draw(st.integers(0, len(b) - 1))
        more = b.scheduled.astype(np.int64)
        more[i] += data.draw(st.integers(1, 512))
        bigger = kernel.step_time(Batch(more, b.computed)).expected_s
        assert bigger >= est.expected_s * SLACK


@FUZZ
@given(st.lists(st.lists(token, min_size=16, max_size=16), min_size=4, max_size=4),
       st.sampled_from([None, np.float32, np.float64, np.int32, np.float16, "x"]))
def test_any_bulk_arrays_price_finite_or_name_the_argument(kernel, rows, dtype):
    try:
        est = kernel.price_many(scheduled=np.asarray(rows, dtype=object).astype(float),
                                dtype=dtype)
    except ArgumentError as exc:
        assert exc.argument in ("scheduled", "dtype")
        return
    assert np.isfinite(est.expected_s).all() and (est.expected_s >= 0).all()


# -- command lines ----------------------------------------------------------------------------------

class _Reached(Exception):
    """The search was reached: every argument of ``plan`` was accepted."""


word = st.one_of(st.sampled_from(["0", "1", "-1", "2.5", "inf", "nan", "1e9", "10000000000",
                                  "", "x", "../x", "/", ".", "-", "1x1@1", "4x1@100,1x9@0"]),
                 st.text(alphabet="ab01-x@,.", max_size=6))
FLAGS = {
    "price": ["--batch", "--pool", "--decode-threshold", "--pad-tokens", "--sm-budget"],
    "memory": ["--pool"],
    "provenance": ["--pool"],
    "replay": ["--requests", "--out", "--pool", "--clock"],
    "plan": ["--gpus", "--gpus-per-node", "--isl", "--osl", "--ttft", "--itl", "--rate",
             "--concurrency", "--requests", "--replay-top", "--seed", "--workers", "--csv",
             "--json", "--plot", "--mode"],
    "derive": ["--name", "--out", "--quant-config"],
}


@st.composite
def command_lines(draw):
    cmd = draw(st.sampled_from(sorted(FLAGS)))
    first = {"price": SCENARIO, "memory": SCENARIO, "provenance": SCENARIO,
             "replay": SCENARIO, "plan": "llama-3.1-8b-instruct",
             "derive": str(GRAPH.parent / "config.json")}[cmd]
    argv = [cmd, draw(st.one_of(st.just(first), word))]
    required = {"price": {"--batch": "1x1@1"}, "replay": {"--requests": "REQS"},
                "plan": {"--chip": "h100", "--gpus": "1", "--isl": "64", "--osl": "4",
                         "--rate": "1", "--workers": "1"},
                "derive": {"--name": "m"}}.get(cmd, {})
    given = dict(required)
    for flag in draw(st.lists(st.sampled_from(FLAGS[cmd]), max_size=3, unique=True)):
        given[flag] = draw(word)
    if cmd == "plan" and "--concurrency" in given:
        given.pop("--rate", None)
    for flag, value in given.items():
        argv += [flag, value]
    return argv


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(argv=command_lines())
def test_any_command_line_answers_or_refuses_without_a_traceback(argv, tmp_path_factory,
                                                                 monkeypatch):
    from jkernel import search

    tmp = tmp_path_factory.mktemp("cli")
    reqs = tmp / "reqs.csv"
    pd.DataFrame({"request_id": [0, 1], "arrival_s": [0.0, 0.1], "input_tokens": [50, 60],
                  "output_tokens": [2, 2]}).to_csv(reqs, index=False)
    argv = [str(reqs) if a == "REQS" else a for a in argv]

    def reached(*a, **k):
        raise _Reached

    monkeypatch.setattr(search, "evaluate", reached)
    if "--out" in argv and argv[0] == "derive":
        argv[argv.index("--out") + 1] = str(tmp / argv[argv.index("--out") + 1].strip("/."))
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.chdir(tmp), contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            rc = cli.main(argv)
    except SystemExit as exc:                       # argparse: usage and a message
        assert exc.code == 2 and "error:" in err.getvalue()
        event(f"{argv[0]}: usage error")
        return
    except _Reached:
        event("plan: every argument accepted")
        return
    event(f"{argv[0]}: exit {rc}")
    if rc == 0:
        assert out.getvalue()
    else:
        text = err.getvalue()
        assert rc == 2 and text.startswith("jkernel: ") and "Traceback" not in text, text
