"""YAML loading (jkernel/documents/_strict.py): libyaml's parser where PyYAML has it, the
strict rules kept (YAML 1.2 floats, duplicate keys and runaway nesting refused, naming the
file), and each file parsed once while unchanged."""

from __future__ import annotations

import math

import pytest
import yaml

from jkernel import Refusal
from jkernel.documents import _strict
from jkernel.documents._strict import load_yaml_documents, read_yaml_file


def test_uses_libyaml_when_pyyaml_has_it():
    assert _strict.USING_LIBYAML == bool(getattr(yaml, "__with_libyaml__", False))


def test_yaml_12_numbers():
    doc, = load_yaml_documents("a: 7.0e3\nb: 1e-6\nc: 3\nd: .5\ne: -2.5E+2\nf: .inf\n"
                               "g: 1_000\nh: '1e3'\n", "x.yaml")
    assert doc == {"a": 7000.0, "b": 1e-6, "c": 3, "d": 0.5, "e": -250.0, "f": math.inf,
                   "g": 1000, "h": "1e3"}
    assert type(doc["b"]) is float and type(doc["c"]) is int


def test_duplicate_key_is_refused_naming_file_and_key():
    """Guards: a duplicate key silently kept the last value."""
    with pytest.raises(Refusal) as info:
        load_yaml_documents("chip: h100\nlimits:\n  tp: 2\n  tp: 4\n", "dup.yaml")
    e = info.value
    assert e.file == "dup.yaml" and e.field == "tp" and "twice" in str(e)
    assert "line 4" in str(e)


@pytest.mark.parametrize("text", [
    "".join("  " * i + f"k{i}:\n" for i in range(5000)) + "  " * 5000 + "v\n",   # block
    "".join("  " * i + "-\n" for i in range(5000)),
    "a: " + "[" * 5000 + "]" * 5000 + "\n",                                     # flow
    "a: " + "[" * 80 + "]" * 80 + "\n",                      # deeper than the limit only
])
def test_deep_nesting_is_refused_not_recursion_error(text):
    """Guards: a 5,000-deep nesting raised a raw RecursionError."""
    with pytest.raises(Refusal) as info:
        load_yaml_documents(text, "deep.yaml")
    assert info.value.file == "deep.yaml" and "nesting deeper than" in str(info.value)


def test_a_file_is_parsed_once_while_unchanged(tmp_path, monkeypatch):
    f = tmp_path / "doc.yaml"
    f.write_text("a: 1\n")
    calls = []
    real = _strict.load_yaml_documents
    monkeypatch.setattr(_strict, "load_yaml_documents",
                        lambda text, file: calls.append(file) or real(text, file))
    assert read_yaml_file(f)[0] == {"a": 1}
    assert read_yaml_file(f)[0] == {"a": 1}
    assert len(calls) == 1
    f.write_text("a: 22\n")                                   # changed: parsed again
    assert read_yaml_file(f)[0] == {"a": 22} and len(calls) == 2


def test_syntax_error_names_the_file():
    with pytest.raises(Refusal) as info:
        load_yaml_documents("a: [1\n", "bad.yaml")
    assert info.value.file == "bad.yaml" and "not valid YAML" in str(info.value)


@pytest.mark.parametrize("var", ["JKERNEL_CATALOG", "JKERNEL_REGISTRY"])
def test_catalog_folder_that_does_not_exist_is_refused(var, tmp_path, monkeypatch, capsys):
    """Guards: JKERNEL_CATALOG pointing nowhere listed nothing without a word."""
    from jkernel import catalog
    from jkernel.cli import main

    monkeypatch.setenv(var, str(tmp_path / "nowhere"))
    root = catalog.catalog_root if var == "JKERNEL_CATALOG" else catalog.registry_root
    with pytest.raises(Refusal) as info:
        root()
    assert var in str(info.value) and "does not exist" in str(info.value)
    assert main(["catalog"]) == 2
    assert "does not exist" in capsys.readouterr().err
