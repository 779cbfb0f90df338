"""Strict decoding of YAML mappings: every key known, every value checked.

A :class:`Reader` wraps one mapping of one document. Each ``req``/``opt`` call consumes a key
and checks its value; ``done()`` refuses any key left over. Every failure is a
:class:`~jkernel.errors.Refusal` with code R1 naming the file, the key's document path and
what is allowed, so nothing is half-built from a bad document.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from .. import limits as _limits
from ..errors import Refusal

_MISSING = object()


#: Deepest nesting of mappings and lists a document may have (the catalog's go 8 deep); a
#: deeper one is refused before it is built (a 5,000-deep document used to raise a raw
#: RecursionError). The limits live in :mod:`jkernel.limits`.
MAX_DEPTH = _limits.MAX_YAML_DEPTH

_FLOAT_12 = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X)

#: libyaml's C parser when PyYAML was built with it (5 × faster on the coefficient sets),
#: else the pure-Python one; both build through the same strict constructor below.
_BASE = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader
USING_LIBYAML = _BASE is not yaml.SafeLoader


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        self.key, self.mark = key, mark


class _TooDeep(yaml.YAMLError):
    def __init__(self, mark):
        self.mark = mark


class _Loader(_BASE):
    """Safe loader with the strict rules: YAML 1.2 floats, no duplicate keys, bounded depth.

    PyYAML follows YAML 1.1, where an exponent needs a sign and a dot, so ``7.0e3`` would be
    read as a string; the catalog's documents (written for a YAML 1.2 reader) use both forms.
    A key given twice in one mapping is refused (YAML forbids it; PyYAML keeps the last).
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            self.flatten_mapping(node)
            seen = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    k = (key_node.tag, key_node.value)
                    if k in seen:
                        raise _DuplicateKey(key_node.value, key_node.start_mark)
                    seen.add(k)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+0123456789."))


class _TooMany(yaml.YAMLError):
    def __init__(self, mark):
        self.mark = mark


class _Recursive(yaml.YAMLError):
    def __init__(self, mark):
        self.mark = mark


def _check_shape(root) -> None:
    """Refuse a composed document nesting deeper than :data:`MAX_DEPTH`, holding more than
    ``MAX_YAML_NODES`` values once its aliases are expanded, or an alias inside itself.

    One pass over the distinct nodes, iterative (no recursion to blow), each node's height
    and expanded size computed once: an alias shares its node, so a "billion laughs"
    document of nine aliases nine times over is refused after visiting a few dozen nodes
    (a walk of the expanded tree, as this check once was, visits all 10⁹)."""
    height: dict[int, int] = {}
    size: dict[int, int] = {}
    open_: set[int] = set()                      # started, not finished: the current path
    stack = [(root, False)]
    while stack:
        n, finished = stack.pop()
        if isinstance(n, yaml.ScalarNode):
            continue
        i = id(n)
        kids = ([x for kv in n.value for x in kv] if isinstance(n, yaml.MappingNode)
                else n.value)
        if finished:
            open_.discard(i)
            h = 1 + max((height[id(k)] for k in kids if not isinstance(k, yaml.ScalarNode)),
                        default=0)
            total = 1 + sum(1 if isinstance(k, yaml.ScalarNode) else size[id(k)]
                            for k in kids)
            if h > MAX_DEPTH:
                raise _TooDeep(n.start_mark)
            if total > _limits.MAX_YAML_NODES:
                raise _TooMany(n.start_mark)
            height[i], size[i] = h, total
            continue
        if i in height:
            continue
        if i in open_:
            raise _Recursive(n.start_mark)
        open_.add(i)
        stack.append((n, True))
        stack.extend((k, False) for k in kids
                     if not isinstance(k, yaml.ScalarNode) and id(k) not in height)


def refuse(reason: str, *, file: str | None, field: str | None, code: str = "R1") -> Refusal:
    return Refusal(code, reason, field=field, file=file)


def _where(mark) -> str:
    return f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""


def load_yaml_documents(text: str, file: str | None) -> list[Any]:
    """Parse a YAML stream into its documents (each parsed once), turning syntax errors,
    duplicate keys and too-deep nesting into R1 refusals naming the file."""
    loader = _Loader(text)
    try:
        docs = []
        while loader.check_node():
            node = loader.get_node()
            _check_shape(node)
            docs.append(loader.construct_document(node))
        return docs
    except _DuplicateKey as exc:
        raise refuse(f"key {exc.key!r} is given twice in one mapping{_where(exc.mark)}; "
                     "YAML allows a key once — remove one of them", file=file,
                     field=str(exc.key)) from None
    except _TooDeep as exc:
        raise refuse(f"nesting deeper than {MAX_DEPTH} levels{_where(exc.mark)}; no jkernel "
                     "document nests that deep", file=file, field=None) from None
    except _TooMany as exc:
        raise refuse(f"more than {_limits.MAX_YAML_NODES:,} values once its aliases are "
                     f"expanded{_where(exc.mark)} (MAX_YAML_NODES: a few aliases can stand "
                     "for billions of values; docs/limits.md)", file=file,
                     field=None) from None
    except _Recursive as exc:
        raise refuse(f"an alias refers to the node that holds it{_where(exc.mark)}: the "
                     "document would be infinite", file=file, field=None) from None
    except RecursionError:        # composing itself ran out of stack (pure-Python parser)
        raise refuse(f"nesting deeper than {MAX_DEPTH} levels; no jkernel document nests "
                     "that deep", file=file, field=None) from None
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):            # libyaml's own limit (1,000)
            raise refuse(f"nesting deeper than {MAX_DEPTH} levels{_where(exc.problem_mark)}; "
                         "no jkernel document nests that deep", file=file,
                         field=None) from None
        raise refuse(f"not valid YAML: {exc}", file=file, field=None) from None
    finally:
        loader.dispose()


_PARSED: dict[tuple, list[Any]] = {}


def read_document_text(path, *, what: str = "document", code_missing: str = "R2",
                       hint: str = "") -> str:
    """The text of one document file, refused (naming the file) when it is missing, a
    directory or not a regular file (code ``code_missing``), unreadable (R2), larger than
    ``MAX_DOCUMENT_BYTES`` or not UTF-8 text (R1). ``hint`` ends the not-found message."""
    from pathlib import Path

    p = Path(path)
    try:
        st = p.stat()
    except (OSError, ValueError):
        st = None
    if st is None:
        raise Refusal(code_missing, f"{what} not found at {p}{hint}", file=str(p))
    if p.is_dir():
        raise Refusal(code_missing, f"{what} expected at {p}, which is a directory",
                      file=str(p))
    if not p.is_file():
        raise Refusal(code_missing, f"{what} expected at {p}, which is not a regular file",
                      file=str(p))
    if st.st_size > _limits.MAX_DOCUMENT_BYTES:
        raise Refusal("R1", f"the {what} is {st.st_size:,} bytes: "
                      + _limits.beyond("MAX_DOCUMENT_BYTES", st.st_size), file=str(p))
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise Refusal("R2", f"cannot read the {what}: {exc.strerror or exc}",
                      file=str(p)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refusal("R1", f"the {what} is not UTF-8 text (byte {exc.start} is "
                      f"{data[exc.start:exc.start + 1]!r}); documents are YAML text",
                      file=str(p)) from None


_PARSED: dict[tuple, list[Any]] = {}


def read_yaml_file(path, code_missing: str = "R2", what: str = "document") -> tuple[Any, str]:
    """Read one single-document YAML file; a missing file is refused with ``code_missing``
    (and an unreadable, oversized or binary one as :func:`read_document_text` says).

    A file is parsed once per process while it is unchanged (keyed by its path, size and
    modification time): a bundle's pools share their chip, model and coefficient files.
    Callers read the result and never change it.
    """
    from pathlib import Path

    p = Path(path)
    try:
        st = p.stat()
    except (OSError, ValueError):
        st = None
    key = None if st is None else (str(p.resolve()), st.st_size, st.st_mtime_ns)
    docs = _PARSED.get(key) if key is not None else None
    if docs is None:
        docs = load_yaml_documents(read_document_text(p, what=what, code_missing=code_missing),
                                   str(p))
        if len(_PARSED) > 256:
            _PARSED.clear()
        if key is not None:
            _PARSED[key] = docs
    if len(docs) != 1:
        raise refuse(f"expected exactly one YAML document, found {len(docs)}", file=str(p),
                     field=None)
    return docs[0], str(p)


def _type_name(v: Any) -> str:
    return "null" if v is None else type(v).__name__


class Reader:
    """Consumes the keys of one mapping with type and range checks.

    Args:
      data: the mapping (anything else is refused).
      file: the file the document came from (None for in-memory documents).
      path: the document path of this mapping, e.g. ``"pools[0].engine"`` ("" at top level).
      comments: accept and discard ``_comment`` / ``_comment_*`` keys (chip, fabric, storage).
    """

    def __init__(self, data: Any, file: str | None, path: str = "", *, comments: bool = False):
        self.file = file
        self.path = path
        if not isinstance(data, Mapping):
            raise refuse(f"expected a mapping, got {_type_name(data)}", file=file,
                         field=path or None)
        self.data = dict(data)
        self.used: set[str] = set()
        self.allowed: list[str] = []
        if comments:
            for key in self.data:
                if isinstance(key, str) and (key == "_comment" or key.startswith("_comment_")):
                    self.used.add(key)

    # -- paths and errors -------------------------------------------------------------
    def field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def error(self, key: str | None, reason: str, code: str = "R1") -> Refusal:
        return refuse(reason, file=self.file, field=self.field(key) if key else (self.path or None),
                      code=code)

    # -- raw access -------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any = _MISSING, *, required: bool = False) -> Any:
        self.allowed.append(key)
        if key not in self.data:
            if required:
                raise self.error(key, "required key is missing")
            return None if default is _MISSING else default
        self.used.add(key)
        return self.data[key]

    # -- typed access -----------------------------------------------------------------
    def str(self, key: str, default: Any = _MISSING, *, required: bool = False,
            choices: Sequence[str] | None = None) -> Any:
        v = self.raw(key, default, required=required)
        if key not in self.data:
            return v
        if not isinstance(v, str):
            raise self.error(key, f"expected a string, got {_type_name(v)} {v!r}")
        if choices is not None and v not in choices:
            raise self.error(key, f"{v!r} is not allowed; allowed: {', '.join(choices)}")
        return v

    def int(self, key: str, default: Any = _MISSING, *, required: bool = False,
            minimum: int | None = None, limit: str = "MAX_DOCUMENT_INTEGER") -> Any:
        """An integer ≥ ``minimum`` and at most the :mod:`jkernel.limits` bound named
        ``limit`` (every document integer fits int64)."""
        v = self.raw(key, default, required=required)
        if key not in self.data:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"expected an integer, got {_type_name(v)} {v!r}")
        if minimum is not None and v < minimum:
            raise self.error(key, f"{v} is out of range; allowed: an integer ≥ {minimum}")
        if v > getattr(_limits, limit):
            raise self.error(key, _limits.beyond(limit, v))
        if v < -_limits.MAX_DOCUMENT_INTEGER:
            raise self.error(key, _limits.beyond("MAX_DOCUMENT_INTEGER", v))
        return v

    def num(self, key: str, default: Any = _MISSING, *, required: bool = False,
            minimum: float | None = None, positive: bool = False,
            maximum: float | None = None) -> Any:
        v = self.raw(key, default, required=required)
        if key not in self.data:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(key, f"expected a finite number, got {_type_name(v)} {v!r}")
        if positive and not v > 0:
            raise self.error(key, f"{v} is out of range; allowed: a number > 0")
        if minimum is not None and v < minimum:
            raise self.error(key, f"{v} is out of range; allowed: a number ≥ {minimum}")
        if maximum is not None and v > maximum:
            raise self.error(key, f"{v} is out of range; allowed: a number ≤ {maximum}")
        return float(v)

    def bool(self, key: str, default: Any = _MISSING, *, required: bool = False) -> Any:
        v = self.raw(key, default, required=required)
        if key not in self.data:
            return v
        if not isinstance(v, bool):
            raise self.error(key, f"expected true or false, got {_type_name(v)} {v!r}")
        return v

    def list(self, key: str, default: Any = _MISSING, *, required: bool = False,
             min_len: int = 0) -> Any:
        v = self.raw(key, default, required=required)
        if key not in self.data:
            return v
        if not isinstance(v, list):
            raise self.error(key, f"expected a list, got {_type_name(v)}")
        if len(v) < min_len:
            raise self.error(key, f"needs at least {min_len} item(s)")
        return v

    def str_list(self, key: str, default: Any = _MISSING, *, required: bool = False,
                 min_len: int = 0) -> Any:
        v = self.list(key, default, required=required, min_len=min_len)
        if key not in self.data:
            return v
        for i, item in enumerate(v):
            if not isinstance(item, str):
                raise self.error(f"{key}[{i}]", f"expected a string, got {_type_name(item)}")
        return tuple(v)

    def sub(self, key: str, *, required: bool = False, comments: bool = False) -> "Reader | None":
        v = self.raw(key, required=required)
        if key not in self.data or v is None and not required:
            return None
        return Reader(v, self.file, self.field(key), comments=comments)

    def done(self) -> None:
        unknown = [k for k in self.data if k not in self.used]
        if unknown:
            allowed = ", ".join(sorted(set(self.allowed))) or "(none)"
            raise self.error(str(unknown[0]), f"unknown key {unknown[0]!r}; allowed here: "
                             f"{allowed}")
