"""Model graph documents (spec documents.md §6): the nine primitives, stack, head, speculator.

A graph is frozen and hashable. ``parse_graph`` validates it strictly (R1 for malformed nodes,
R19 for unknown emit conditions and undeclared layer kinds); ``graph_to_dict`` writes it back
in the document layout, so ``parse(write(parse(doc))) == parse(doc)``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from .. import limits as _limits
from ._strict import Reader, read_yaml_file

__all__ = ["DTYPE_BYTES", "AttentionKind", "RECURRENT_KINDS", "EMIT_CONDITIONS", "Node",
           "LayerKind", "Stack", "Speculator", "ModelGraph", "parse_graph", "load_graph",
           "graph_to_dict", "dump_graph"]

#: Bytes per element, block scales excluded (documents.md §6.2).
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0,
               "nvfp4": 0.5, "mxfp4": 0.5, "int4": 0.5}


class AttentionKind(StrEnum):
    """An attention node's ``kind`` (documents.md §6.3). A member equals its document
    string (``AttentionKind.MLA == "mla"``) and hashes as it."""

    GQA = "gqa"
    SWA = "swa"
    MLA = "mla"
    SPARSE_MLA = "sparse_mla"

    @property
    def latent(self) -> bool:
        """One shared latent per token instead of keys and values per KV head (MLA)."""
        return self in (AttentionKind.MLA, AttentionKind.SPARSE_MLA)

    @property
    def dcp_shardable(self) -> bool:
        """Decode context parallelism shards this kind's cache (step.md §6.9); a sliding
        window's is not."""
        return self is not AttentionKind.SWA


RECURRENT_KINDS = ("mamba2", "kda", "gdn")
EMIT_CONDITIONS = ("", "tensor_parallel", "expert_parallel", "tensor_parallel_unless_sp_moe")
COLLECTIVE_OPS = ("AllReduce", "AllGather", "ReduceScatter", "All2All")

# Parameters each primitive prices (beyond op, role, emit); the first tuple is required.
_OP_PARAMS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "GEMM": (("n", "k"), ("weight_dtype",)),
    "GroupedGEMM": (("n", "k", "experts", "top_k"),
                    ("shared_experts", "shared_intermediate_size", "latent_size",
                     "weight_dtype")),
    "Attention": (("kind", "n_q", "n_kv", "d_h"),
                  ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                   "window", "index_topk", "compress_ratio")),
    "RecurrentUpdate": (("recurrent_kind", "n_heads", "state_size"),
                        ("n_groups", "conv_kernel", "intermediate_size", "state_dtype", "d_h")),
    "Elementwise": ((), ("bytes_per_token",)),
    "AllReduce": ((), ()), "AllGather": ((), ()), "ReduceScatter": ((), ()),
    "All2All": ((), ()),
}
_STR_PARAMS = {"weight_dtype", "kind", "recurrent_kind", "state_dtype"}
_FLOAT_PARAMS = {"bytes_per_token"}


@dataclass(frozen=True)
class Node:
    """One launched piece of GPU work. Fields a primitive does not price stay None."""

    op: str
    role: str = ""
    emit: str = ""
    n: int | None = None
    k: int | None = None
    weight_dtype: str | None = None
    experts: int | None = None
    top_k: int | None = None
    shared_experts: int | None = None
    shared_intermediate_size: int | None = None
    latent_size: int | None = None
    kind: str | None = None
    n_q: int | None = None
    n_kv: int | None = None
    d_h: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    window: int | None = None
    index_topk: int | None = None
    compress_ratio: int | None = None
    recurrent_kind: str | None = None
    n_heads: int | None = None
    state_size: int | None = None
    n_groups: int | None = None
    conv_kernel: int | None = None
    intermediate_size: int | None = None
    state_dtype: str | None = None
    bytes_per_token: float | None = None

    def get(self, name: str, default: int = 0):
        v = getattr(self, name)
        return default if v is None else v


@dataclass(frozen=True)
class LayerKind:
    id: str
    nodes: tuple[Node, ...]
    edges: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Stack:
    prologue: tuple[str, ...] = ()
    pattern: tuple[str, ...] = ()
    repeat: int = 0
    epilogue: tuple[str, ...] = ()

    def expanded(self) -> tuple[str, ...]:
        return self.prologue + self.pattern * self.repeat + self.epilogue


@dataclass(frozen=True)
class Speculator:
    method: str
    num_spec_tokens: int
    stack: Stack


@dataclass(frozen=True)
class ModelGraph:
    name: str
    derived_from: tuple[tuple[str, Any], ...]   # (format, path, sha256, deriver_version)
    hidden_size: int
    vocab_size: int
    weight_dtype: str
    layer_kinds: tuple[LayerKind, ...]
    stack: Stack
    head: tuple[Node, ...] = ()
    speculator: Speculator | None = None
    modality: str = "text_only"
    tie_word_embeddings: bool | None = None

    def kind(self, kind_id: str) -> LayerKind:
        for lk in self.layer_kinds:
            if lk.id == kind_id:
                return lk
        raise KeyError(kind_id)

    @property
    def total_layers(self) -> int:
        return len(self.stack.expanded())


# -- parsing -------------------------------------------------------------------------------

def _dtype(r: Reader, key: str, value: Any) -> str:
    if value not in DTYPE_BYTES:
        raise r.error(key, f"unknown dtype {value!r}; allowed: {', '.join(DTYPE_BYTES)}")
    return value


def _parse_node(data: Any, file: str | None, path: str) -> Node:
    r = Reader(data, file, path)
    op = r.str("op", required=True, choices=tuple(_OP_PARAMS))
    role = r.str("role", "")
    emit = r.str("emit", "")
    if emit not in EMIT_CONDITIONS:
        raise r.error("emit", f"unknown emit condition {emit!r}; allowed: "
                      f"{', '.join(repr(e) for e in EMIT_CONDITIONS)}", code="R19")
    if op in COLLECTIVE_OPS and not r.has("emit"):
        raise r.error("emit", f"{op} needs an emit condition")
    required, optional = _OP_PARAMS[op]
    values: dict[str, Any] = {}
    for key in required + optional:
        if key in _STR_PARAMS:
            v = r.str(key, None, required=key in required)
            if v is not None and key in ("weight_dtype",):
                v = _dtype(r, key, v)
        elif key in _FLOAT_PARAMS:
            v = r.num(key, None, required=key in required, minimum=0.0)
        else:
            v = r.int(key, None, required=key in required, minimum=0, limit="MAX_WIDTH")
        if v is not None:
            values[key] = v
    other = [k for k in r.data if k not in r.used]
    if other:
        priced = ", ".join(("op", "role", "emit") + required + optional)
        raise r.error(other[0], f"{op} does not price {other[0]!r}; allowed on {op}: {priced}")
    node = Node(op=op, role=role, emit=emit, **values)
    if op == "Attention":
        if node.kind not in tuple(AttentionKind):
            raise r.error("kind", f"unknown attention kind {node.kind!r}; allowed: "
                          f"{', '.join(AttentionKind)}")
        if node.n_kv > node.n_q:
            raise r.error("n_kv", f"n_kv {node.n_kv} exceeds n_q {node.n_q}")
        if AttentionKind(node.kind).latent and node.n_kv != 1:
            raise r.error("n_kv", f"a {node.kind} attention holds one latent: n_kv must be 1")
        if node.kind == "swa" and not node.window:
            raise r.error("window", "required on a swa attention")
        if node.window is not None and node.kind not in ("swa", "sparse_mla"):
            raise r.error("window", f"allowed only on swa and sparse_mla, not {node.kind}")
        if node.kind != "sparse_mla":
            for key in ("index_topk", "compress_ratio"):
                if getattr(node, key) is not None:
                    raise r.error(key, f"allowed only on sparse_mla, not {node.kind}")
        elif node.index_topk is None and node.compress_ratio is None:
            raise r.error("index_topk", "sparse_mla needs index_topk or compress_ratio")
    if op == "GroupedGEMM":
        if node.top_k > node.experts:
            raise r.error("top_k", f"top_k {node.top_k} exceeds experts {node.experts}")
        if node.shared_intermediate_size is not None and not node.shared_experts:
            raise r.error("shared_intermediate_size", "requires shared_experts")
    if op == "RecurrentUpdate":
        if node.recurrent_kind not in RECURRENT_KINDS:
            raise r.error("recurrent_kind", f"unknown recurrent kind {node.recurrent_kind!r}; "
                          f"allowed: {', '.join(RECURRENT_KINDS)}")
        if node.recurrent_kind == "mamba2":
            for key in ("n_groups", "conv_kernel", "intermediate_size"):
                if getattr(node, key) is None:
                    raise r.error(key, "required on a mamba2 RecurrentUpdate")
    return node


def _parse_nodes(items: Any, file, path: str, r: Reader, key: str) -> tuple[Node, ...]:
    if not isinstance(items, list) or not items:
        raise r.error(key, "expected a non-empty list of nodes")
    return tuple(_parse_node(n, file, f"{path}[{i}]") for i, n in enumerate(items))


def _parse_stack(r: Reader, declared: set[str], allow: tuple[str, ...]) -> Stack:
    parts = {}
    for key in ("prologue", "pattern", "epilogue"):
        if key in allow:
            parts[key] = r.str_list(key, ())
    repeat = r.int("repeat", 0, minimum=1, limit="MAX_LAYERS")
    if parts.get("pattern") and not r.has("repeat"):
        raise r.error("repeat", "required when pattern is present")
    layers = (len(parts.get("prologue", ())) + len(parts.get("pattern", ())) * repeat
              + len(parts.get("epilogue", ())))
    if layers > _limits.MAX_LAYERS:          # counted before the stack is ever expanded
        raise r.error("repeat" if repeat > 1 else None,
                      f"the stack has {layers:,} layers: "
                      + _limits.beyond("MAX_LAYERS", layers))
    for key, ids in parts.items():
        for i, kid in enumerate(ids):
            if kid not in declared:
                raise r.error(f"{key}[{i}]", f"names undeclared layer kind {kid!r}; declared: "
                              f"{', '.join(sorted(declared))}", code="R19")
    r.done()
    return Stack(parts.get("prologue", ()), parts.get("pattern", ()), repeat,
                 parts.get("epilogue", ()))


def _check_edges(edges: Any, n_nodes: int, r: Reader) -> tuple[tuple[int, int], ...]:
    if edges is None:
        return ()
    if not isinstance(edges, list):
        raise r.error("edges", "expected a list of [from, to] pairs")
    out = []
    for i, e in enumerate(edges):
        if (not isinstance(e, list) or len(e) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in e)
                or not all(0 <= x < n_nodes for x in e)):
            raise r.error(f"edges[{i}]", f"expected a pair of node indices in [0, {n_nodes})")
        out.append((e[0], e[1]))
    # acyclic: Kahn's algorithm
    indeg = [0] * n_nodes
    succ: dict[int, list[int]] = {}
    for a, b in out:
        succ.setdefault(a, []).append(b)
        indeg[b] += 1
    ready = [i for i in range(n_nodes) if indeg[i] == 0]
    seen = 0
    while ready:
        a = ready.pop()
        seen += 1
        for b in succ.get(a, []):
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    if seen != n_nodes:
        raise r.error("edges", "the edges form a cycle")
    return tuple(out)


def parse_graph(data: Any, file: str | None = None, expected_name: str | None = None
                ) -> ModelGraph:
    """Validate one graph document (a mapping) into a :class:`ModelGraph`."""
    r = Reader(data, file)
    r.str("kind", required=True, choices=("ModelGraph",))
    name = r.str("name", required=True)
    if expected_name is not None and name != expected_name:
        raise r.error("name", f"{name!r} must equal the catalog directory name "
                      f"{expected_name!r}")
    df = r.sub("derived_from", required=True)
    fmt = df.str("format", required=True)
    dpath = df.str("path", required=True)
    sha = df.str("sha256", required=True)
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha.lower()):
        raise df.error("sha256", "expected 64 hexadecimal digits")
    dver = df.int("deriver_version", required=True, minimum=1)
    df.done()
    g = r.sub("global", required=True)
    hidden = g.int("hidden_size", required=True, minimum=1, limit="MAX_WIDTH")
    vocab = g.int("vocab_size", required=True, minimum=1, limit="MAX_WIDTH")
    tie = g.bool("tie_word_embeddings", None)
    wdt = g.str("weight_dtype", required=True)
    _dtype(g, "weight_dtype", wdt)
    g.done()
    modality = r.str("modality", "text_only",
                     choices=("text_only", "text_decoder_of_multimodal"))
    kinds_raw = r.list("layer_kinds", required=True, min_len=1)
    nodes = sum(len(x) for x in [k.get("nodes") for k in kinds_raw if isinstance(k, dict)]
                + [r.data.get("head")] if isinstance(x, list))
    if nodes > _limits.MAX_GRAPH_NODES:          # counted before any node is parsed
        raise r.error("layer_kinds", f"{nodes:,} nodes: "
                      + _limits.beyond("MAX_GRAPH_NODES", nodes))
    kinds = []
    for i, kd in enumerate(kinds_raw):
        kr = Reader(kd, file, f"layer_kinds[{i}]")
        kid = kr.str("id", required=True)
        nodes = _parse_nodes(kr.raw("nodes", required=True), file, f"layer_kinds[{i}].nodes",
                             kr, "nodes")
        edges = _check_edges(kr.raw("edges", None), len(nodes), kr)
        kr.done()
        if any(k.id == kid for k in kinds):
            raise kr.error("id", f"duplicate layer kind id {kid!r}")
        kinds.append(LayerKind(kid, nodes, edges))
    declared = {k.id for k in kinds}
    stack = _parse_stack(r.sub("stack", required=True), declared,
                         ("prologue", "pattern", "epilogue"))
    if not stack.expanded():
        raise r.error("stack", "the stack has no layers")
    head = ()
    if r.has("head"):
        head = _parse_nodes(r.raw("head"), file, "head", r, "head")
    spec = None
    sr = r.sub("speculator")
    if sr is not None:
        method = sr.str("method", required=True)
        nst = sr.int("num_spec_tokens", required=True, minimum=1, limit="MAX_WIDTH")
        st = _parse_stack(sr.sub("stack", required=True), declared, ("pattern",))
        if not st.pattern:
            raise sr.error("stack", "needs a pattern with repeat ≥ 1")
        sr.done()
        spec = Speculator(method, nst, st)
    r.done()
    return ModelGraph(name=name, derived_from=(("format", fmt), ("path", dpath),
                                               ("sha256", sha), ("deriver_version", dver)),
                      hidden_size=hidden, vocab_size=vocab, weight_dtype=wdt,
                      layer_kinds=tuple(kinds), stack=stack, head=head, speculator=spec,
                      modality=modality, tie_word_embeddings=tie)


def load_graph(path: Path | str, expected_name: str | None = None) -> ModelGraph:
    data, file = read_yaml_file(path, what="model graph")
    return parse_graph(data, file, expected_name)


# -- writing -------------------------------------------------------------------------------

def _node_to_dict(node: Node) -> dict:
    out: dict[str, Any] = {"op": node.op}
    if node.role:
        out["role"] = node.role
    if node.emit:
        out["emit"] = node.emit
    for f in fields(Node):
        if f.name in ("op", "role", "emit"):
            continue
        v = getattr(node, f.name)
        if v is not None:
            out[f.name] = v
    return out


def _stack_to_dict(stack: Stack) -> dict:
    out: dict[str, Any] = {}
    if stack.prologue:
        out["prologue"] = list(stack.prologue)
    if stack.pattern:
        out["pattern"] = list(stack.pattern)
        out["repeat"] = stack.repeat
    if stack.epilogue:
        out["epilogue"] = list(stack.epilogue)
    return out


def graph_to_dict(g: ModelGraph) -> dict:
    """The document layout of ``g`` (the inverse of :func:`parse_graph`)."""
    out: dict[str, Any] = {"kind": "ModelGraph", "name": g.name}
    if g.modality != "text_only":
        out["modality"] = g.modality
    out["derived_from"] = dict(g.derived_from)
    glob: dict[str, Any] = {"hidden_size": g.hidden_size, "vocab_size": g.vocab_size}
    if g.tie_word_embeddings is not None:
        glob["tie_word_embeddings"] = g.tie_word_embeddings
    glob["weight_dtype"] = g.weight_dtype
    out["global"] = glob
    out["layer_kinds"] = [
        {"id": lk.id, "nodes": [_node_to_dict(n) for n in lk.nodes],
         **({"edges": [list(e) for e in lk.edges]} if lk.edges else {})}
        for lk in g.layer_kinds]
    out["stack"] = _stack_to_dict(g.stack)
    if g.head:
        out["head"] = [_node_to_dict(n) for n in g.head]
    if g.speculator is not None:
        out["speculator"] = {"method": g.speculator.method,
                             "num_spec_tokens": g.speculator.num_spec_tokens,
                             "stack": _stack_to_dict(g.speculator.stack)}
    return out


def dump_graph(g: ModelGraph) -> str:
    return yaml.safe_dump(graph_to_dict(g), sort_keys=False, width=100)

