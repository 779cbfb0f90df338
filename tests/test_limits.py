"""The limits of jkernel.limits, enforced before any work: a document or config of a few
kilobytes that asks for a billion of anything is refused at once, naming the file, the
field, the limit and why, and never builds, allocates or loops first.

Each test guards a behaviour once seen: a 1.5 KB "billion laughs" YAML hung the loader in
its depth check; ``nodes: 10³⁰`` and ``dp: 10⁶`` bundles priced and their replay grew
without bound; a config of ``num_hidden_layers: 10⁹`` grew to 14.6 GB in ``jkernel
derive``; a stated engine setting of 0 was read as unset."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

import jkernel
from jkernel import Refusal, limits
from jkernel.documents import parse_bundle, parse_graph
from jkernel.documents._strict import load_yaml_documents, read_yaml_file

ROOT = Path(__file__).resolve().parent.parent
SMALL = ROOT / "catalog" / "scenarios" / "llama-3.1-8b-h100-tp1.yaml"
GRAPH = ROOT / "catalog" / "models" / "llama-3.1-8b-instruct" / "graph.yaml"
CONFIG = ROOT / "catalog" / "models" / "llama-3.1-8b-instruct" / "config.json"


def bundle_docs() -> list[dict]:
    return list(yaml.safe_load_all(SMALL.read_text()))


def refusal_of(call) -> Refusal:
    with pytest.raises(Refusal) as info:
        call()
    return info.value


# -- the table ------------------------------------------------------------------------------

def test_every_limit_is_a_module_constant_with_a_reason():
    names = [lim.name for lim in limits.LIMITS]
    assert len(names) == len(set(names))
    for lim in limits.LIMITS:
        assert getattr(limits, lim.name) == lim.value, lim.name
        assert lim.value > 0 and lim.bounds and lim.why


def test_docs_list_every_limit_with_its_value():
    """docs/limits.md is the user's table of the limits: each name and value appears."""
    text = (ROOT / "docs" / "limits.md").read_text()
    for lim in limits.LIMITS:
        shown = f"{lim.value:,}" if isinstance(lim.value, int) else f"{lim.value:g}"
        assert re.search(rf"`{lim.name}`[^\n]*{re.escape(shown)}", text), lim.name
    assert "limits.md" in (ROOT / "docs" / "README.md").read_text()


def test_beyond_names_the_value_the_limit_and_why():
    text = limits.beyond("MAX_LAYERS", 10 ** 9)
    assert "1,000,000,000" in text and "1,024" in text and "MAX_LAYERS" in text
    assert "docs/limits.md" in text


# -- YAML -----------------------------------------------------------------------------------

LAUGHS = "\n".join(
    [f"a: &a [{', '.join(['lol'] * 9)}]"]
    + [f"{c}: &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")])


def test_billion_laughs_yaml_is_refused_at_once():
    """A 1.5 KB document whose aliases stand for 9⁹ values hung the depth check, which
    walked the expanded tree; each distinct node is now visited once."""
    assert len(LAUGHS) < 2000
    t0 = time.perf_counter()
    err = refusal_of(lambda: load_yaml_documents(LAUGHS, "laughs.yaml"))
    assert time.perf_counter() - t0 < 2.0
    assert err.file == "laughs.yaml" and "aliases are expanded" in str(err)
    assert "MAX_YAML_NODES" in str(err)


@pytest.mark.parametrize("text", ["a: &a [1, *a]", "a: &a {b: *a}"])
def test_an_alias_inside_itself_is_refused(text):
    err = refusal_of(lambda: load_yaml_documents(text, "loop.yaml"))
    assert "alias refers to the node that holds it" in str(err)


def test_aliases_within_the_limit_still_load():
    docs = load_yaml_documents("a: &a [1, 2]\nb: [*a, *a]\n", "ok.yaml")
    assert docs == [{"a": [1, 2], "b": [[1, 2], [1, 2]]}]


def test_deep_nesting_is_still_refused():
    text = "[" * 200 + "]" * 200
    assert "nesting deeper than 64" in str(refusal_of(lambda: load_yaml_documents(text, "d")))


def test_oversized_binary_and_directory_documents_are_refused_naming_the_file(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(limits.MAX_DOCUMENT_BYTES + 1)          # sparse: no real bytes written
    err = refusal_of(lambda: read_yaml_file(big))
    assert err.file == str(big) and "MAX_DOCUMENT_BYTES" in str(err)
    binary = tmp_path / "chip.yaml"
    binary.write_bytes(b"\x89PNG\x00\xff")
    assert "not UTF-8 text" in str(refusal_of(lambda: read_yaml_file(binary)))
    assert "is a directory" in str(refusal_of(lambda: read_yaml_file(tmp_path)))


def test_unreadable_bundle_is_a_refusal_not_a_traceback(tmp_path, monkeypatch):
    """An unreadable bundle raised a raw PermissionError (simulated: the tests may run as
    root, who reads anything)."""
    p = tmp_path / "b.yaml"
    p.write_text(SMALL.read_text())

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    err = refusal_of(lambda: jkernel.open_inputs(str(p)))
    assert err.code == "R2" and err.file == str(p) and "Permission denied" in str(err)


def test_binary_bundle_is_refused_naming_the_file(tmp_path):
    p = tmp_path / "b.yaml"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    err = refusal_of(lambda: jkernel.open_inputs(str(p)))
    assert err.file == str(p) and "not UTF-8" in str(err)


# -- bundles --------------------------------------------------------------------------------

def _bundle(**changes):
    sc, dep = bundle_docs()
    for key, value in changes.items():
        where, field = key.split("__")
        target = {"cluster": sc["cluster"], "pool": dep["pools"][0],
                  "parallel": dep["pools"][0]["parallel"],
                  "engine": dep["pools"][0]["engine"]}[where]
        target[field] = value
    sc["cluster"].setdefault("fabric", "ib-400g")
    return sc, dep


@pytest.mark.parametrize("changes, field, limit", [
    (dict(cluster__nodes=10 ** 30, pool__nodes=10 ** 30), "scenario.cluster.nodes",
     "MAX_CLUSTER_NODES"),
    (dict(cluster__nodes=10 ** 6, pool__nodes=10 ** 6, parallel__dp=10 ** 6),
     "scenario.cluster.nodes", "MAX_CLUSTER_NODES"),
    (dict(parallel__dp=10 ** 6), "deployment.pools[0].parallel.dp", "MAX_DATA_PARALLEL"),
    (dict(parallel__tp=10 ** 6), "deployment.pools[0].parallel.tp", "MAX_CLUSTER_GPUS"),
    (dict(cluster__gpus_per_node=10 ** 4), "scenario.cluster.gpus_per_node",
     "MAX_GPUS_PER_NODE"),
    (dict(cluster__nodes=4096, pool__nodes=4096, cluster__gpus_per_node=16),
     "scenario.cluster.nodes", "MAX_CLUSTER_GPUS"),
    (dict(engine__max_num_batched_tokens=2 ** 40),
     "deployment.pools[0].engine.max_num_batched_tokens", "INT32_MAX"),
    (dict(engine__block_size=10 ** 30), "deployment.pools[0].engine.block_size",
     "INT32_MAX"),
])
def test_huge_bundle_values_are_refused_before_pricing(changes, field, limit):
    """``nodes: 10³⁰`` and ``dp: 10⁶`` priced, and their replay grew ~150 MB/s."""
    err = refusal_of(lambda: parse_bundle(_bundle(**changes), "huge.yaml"))
    assert err.code == "R1" and err.field == field and err.file == "huge.yaml"
    assert limit in str(err) and "docs/limits.md" in str(err)


@pytest.mark.parametrize("key", ["block_size", "max_num_seqs", "max_num_batched_tokens",
                                 "max_model_len"])
def test_a_stated_engine_setting_of_zero_is_refused_not_read_as_unset(key):
    """``max_num_seqs: 0`` was read as unset (the default 256 priced); vLLM refuses 0."""
    err = refusal_of(lambda: parse_bundle(_bundle(**{f"engine__{key}": 0}), "z.yaml"))
    assert err.field == f"deployment.pools[0].engine.{key}"
    assert "not 'unset'" in str(err) and "leave the key out" in str(err)


def test_unstated_engine_settings_still_read_as_zero():
    sc, dep = bundle_docs()
    dep["pools"][0]["engine"] = {}
    _, d = parse_bundle([sc, dep])
    assert d.pools[0].engine.max_num_seqs == 0 and d.pools[0].engine.block_size == 0


# -- model graphs ---------------------------------------------------------------------------

def _graph():
    return yaml.safe_load(GRAPH.read_text())


def test_a_graph_stack_of_a_billion_layers_is_refused_before_it_is_expanded():
    g = _graph()
    g["stack"]["repeat"] = 10 ** 9
    t0 = time.perf_counter()
    err = refusal_of(lambda: parse_graph(g, "graph.yaml"))
    assert time.perf_counter() - t0 < 1.0
    assert err.field == "stack.repeat" and "MAX_LAYERS" in str(err)


def test_a_graph_stack_past_the_layer_limit_is_refused():
    g = _graph()
    g["stack"]["repeat"] = limits.MAX_LAYERS          # plus the stated prologue/epilogue
    g["stack"]["prologue"] = g["stack"].get("prologue", []) + [g["layer_kinds"][0]["id"]]
    err = refusal_of(lambda: parse_graph(g, "graph.yaml"))
    assert f"{limits.MAX_LAYERS + 1:,} layers" in str(err)


def test_a_graph_of_too_many_nodes_is_refused_before_they_are_parsed():
    """Aliases let a few kilobytes list a million nodes, each a term of the step program."""
    g = _graph()
    g["layer_kinds"][0]["nodes"] = g["layer_kinds"][0]["nodes"] * 500
    err = refusal_of(lambda: parse_graph(g, "graph.yaml"))
    assert err.field == "layer_kinds" and "MAX_GRAPH_NODES" in str(err)


def test_a_graph_width_past_the_limit_is_refused():
    g = _graph()
    g["global"]["hidden_size"] = 10 ** 12
    err = refusal_of(lambda: parse_graph(g, "graph.yaml"))
    assert err.field == "global.hidden_size" and "MAX_WIDTH" in str(err)
    g = _graph()
    g["layer_kinds"][0]["nodes"][1]["n"] = 2 ** 40
    err = refusal_of(lambda: parse_graph(g, "graph.yaml"))
    assert err.field.endswith(".n") and "MAX_WIDTH" in str(err)


# -- derive ---------------------------------------------------------------------------------

def _config(**changes) -> dict:
    cfg = json.loads(CONFIG.read_text())
    cfg.update(changes)
    return cfg


def test_derive_refuses_a_billion_layers_before_building_them():
    """``num_hidden_layers: 1e9`` grew ``jkernel derive`` to 14.6 GB in 20 s."""
    from jkernel.derive import derive_graph

    t0 = time.perf_counter()
    err = refusal_of(lambda: derive_graph(_config(num_hidden_layers=1e9), name="x",
                                          sha256="0" * 64))
    assert time.perf_counter() - t0 < 1.0
    assert err.field == "num_hidden_layers" and "MAX_LAYERS" in str(err)


def test_derive_refuses_a_huge_width():
    from jkernel.derive import derive_graph

    err = refusal_of(lambda: derive_graph(_config(hidden_size=10 ** 15), name="x",
                                          sha256="0" * 64))
    assert err.field == "hidden_size" and "MAX_WIDTH" in str(err)


def test_derive_refuses_a_deeply_nested_json_naming_the_file(tmp_path):
    from jkernel.derive import derive_file

    p = tmp_path / "config.json"
    p.write_text("[" * 100_000 + "]" * 100_000)
    err = refusal_of(lambda: derive_file(p, name="x"))
    assert err.file == str(p) and "nests too deeply" in str(err)
