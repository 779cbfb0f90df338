"""HF ``config.json`` → model graph document (spec documents.md §6, conventions §6.7).

The deriver is mechanical: every number in a derived graph is read from, or computed from, a
field of the vendor's HF ``config.json`` (plus, for ModelOpt checkpoints, the sibling
``hf_quant_config.json``). Anything it cannot place raises :class:`jkernel.errors.Refusal`
with code ``R1`` and the offending config field; it never guesses silently.

Units used throughout this module:

* ``n``, ``k``, ``hidden_size``, head sizes, intermediate sizes: **elements** (matrix dims);
* ``bytes_per_token`` on ``Elementwise`` nodes: **bytes per token** (HBM read + write);
* ``window``, ``index_topk``: **tokens**;
* ``sha256``: 64 lowercase hex digits of the config file's bytes as read (D37).

Public entry points: :func:`derive_graph`, :func:`derive_file`, :func:`write_model`,
:func:`regenerate_catalog` and :data:`SHIPPED_MODELS`. Run
``python -m jkernel.derive --hf-configs DIR --out catalog/models`` to regenerate the catalog.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from jkernel import limits as _limits
from jkernel.errors import Refusal

__all__ = ["DERIVER_VERSION", "SHIPPED_MODELS", "derive_graph", "derive_file", "write_model",
           "regenerate_catalog", "main"]

#: ``derived_from.deriver_version`` written into every graph.
DERIVER_VERSION = 1

#: Catalog name → (HF config file name in the hf-configs directory, ModelOpt
#: ``hf_quant_config.json`` file name or None).
SHIPPED_MODELS: dict[str, tuple[str, str | None]] = {
    # The Llama 3.1 configs are the base repositories; the Instruct checkpoints share the
    # architecture config byte-for-byte in every field the deriver reads.
    "llama-3.1-8b-instruct": ("meta-llama--Meta-Llama-3.1-8B_config.json", None),
    "llama-3.1-70b-instruct": ("meta-llama--Meta-Llama-3.1-70B_config.json", None),
    "llama-3.1-405b": ("meta-llama--Meta-Llama-3.1-405B_config.json", None),
    "qwen3-32b": ("Qwen--Qwen3-32B_config.json", None),
    "qwen3-30b-a3b": ("Qwen--Qwen3-30B-A3B_config.json", None),
    "qwen3-235b-a22b": ("Qwen--Qwen3-235B-A22B_config.json", None),
    "mixtral-8x7b-v0.1": ("mistralai--Mixtral-8x7B-v0.1_config.json", None),
    "mixtral-8x22b-v0.1": ("mistralai--Mixtral-8x22B-v0.1_config.json", None),
    "deepseek-v3": ("deepseek-ai--DeepSeek-V3_config.json", None),
    "kimi-k2.5": ("moonshotai--Kimi-K2.5_config.json", None),
    "gpt-oss-120b": ("openai--gpt-oss-120b_config.json", None),
    "gpt-oss-20b": ("openai--gpt-oss-20b_config.json", None),
    "minimax-m2.5": ("MiniMaxAI--MiniMax-M2.5_config.json", None),
    "llama-4-scout-17b-16e": ("meta-llama--Llama-4-Scout-17B-16E-Instruct_config.json", None),
    "deepseek-v3.2": ("deepseek-ai--DeepSeek-V3.2_config.json", None),
    # §7 lists glm-5 with fp8 weights (+ bf16 nodes): the FP8 checkpoint's config.
    "glm-5": ("zai-org--GLM-5-FP8_config.json", None),
    "qwen3.5-397b-a17b": ("Qwen--Qwen3.5-397B-A17B_config.json", None),
    "nemotron-3-nano-30b-a3b": ("nvidia--NVIDIA-Nemotron-3-Nano-30B-A3B-BF16_config.json", None),
    # No BF16 config of Nemotron-3-Super is available; the FP8 checkpoint is shipped.
    "nemotron-3-super-120b-a12b": (
        "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-FP8_config.json",
        "nvidia--NVIDIA-Nemotron-3-Super-120B-A12B-FP8_hf_quant_config.json"),
    "kimi-k3": ("moonshotai--Kimi-K3_config.json", None),
    "minimax-m3": ("MiniMaxAI--MiniMax-M3_config.json", None),
}

# -- dtypes ------------------------------------------------------------------------------

_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                 "float": "fp32"}

# ModelOpt ``quant_algo`` → graph dtype (documents.md §6.2 names).
_MODELOPT_ALGOS = {
    "FP8": "fp8", "FP8_PER_CHANNEL_PER_TOKEN": "fp8", "FP8_PB_WO": "fp8",
    "FP8_BLOCK_SCALES": "fp8", "NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "NVFP4_AWQ": "nvfp4",
    "MXFP4": "mxfp4", "W4A16_AWQ": "int4", "W4A8_AWQ": "int4", "INT4_AWQ": "int4",
    "W8A8_SQ_PER_CHANNEL": "int8", "INT8_SQ": "int8", "INT8": "int8",
}

_MISSING = object()


class _Cfg:
    """Read access to one (possibly nested) HF config mapping, refusing with R1 by field."""

    def __init__(self, data: Mapping, prefix: str, file: str | None):
        if not isinstance(data, Mapping):
            raise Refusal("R1", f"expected a JSON object, got {type(data).__name__}",
                          field=prefix.rstrip(".") or None, file=file)
        self.d = data
        self.prefix = prefix
        self.file = file

    def field(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def refuse(self, key: str, reason: str):
        raise Refusal("R1", reason, field=self.field(key), file=self.file)

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        v = self.d.get(key)
        return default if v is None else v

    def int(self, key: str, default: Any = _MISSING, *, minimum: int = 1, what: str = "",
            limit: str = "MAX_WIDTH") -> Any:
        """An integer ≥ ``minimum`` and at most the :mod:`jkernel.limits` bound ``limit``
        (every width ``MAX_WIDTH``; layer counts ``MAX_LAYERS``)."""
        v = self.d.get(key)
        if v is None:
            if default is _MISSING:
                self.refuse(key, f"required config field {self.field(key)!r} is missing; "
                                 f"expected {what or 'a positive integer'}")
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            self.refuse(key, f"config field {self.field(key)!r} = {v!r} is not an integer; "
                             f"expected {what or 'a positive integer'}")
        if v < minimum:
            self.refuse(key, f"config field {self.field(key)!r} = {v!r} is below {minimum}; "
                             f"expected {what or 'a positive integer'}")
        if v > getattr(_limits, limit):
            self.refuse(key, _limits.beyond(limit, v))
        return v

    def int_any(self, keys: Sequence[str], default: Any = _MISSING, *, minimum: int = 1,
                what: str = "") -> Any:
        for key in keys:
            if self.has(key):
                return self.int(key, minimum=minimum, what=what)
        if default is _MISSING:
            names = " / ".join(repr(self.field(k)) for k in keys)
            self.refuse(keys[0], f"required config field {names} is missing; "
                                 f"expected {what or 'a positive integer'}")
        return default

    def bool(self, key: str, default: Any = None) -> Any:
        v = self.d.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.refuse(key, f"config field {self.field(key)!r} = {v!r} is not a boolean")
        return v

    def sub(self, key: str) -> "_Cfg | None":
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, Mapping):
            self.refuse(key, f"config field {self.field(key)!r} is not an object")
        return _Cfg(v, f"{self.prefix}{key}.", self.file)

    def list(self, key: str, length: int | None = None, items: type | None = None
             ) -> list | None:
        """A list (``length`` entries when given; each an ``items``, never a bool, when
        given: ``str`` for module names, ``int`` for layer indices)."""
        v = self.d.get(key)
        if v is None:
            return None
        if not isinstance(v, list):
            self.refuse(key, f"config field {self.field(key)!r} is not a list")
        if length is not None and len(v) != length:
            self.refuse(key, f"config field {self.field(key)!r} has {len(v)} entries; "
                             f"expected one per layer ({length})")
        if items is not None:
            for i, x in enumerate(v):
                if isinstance(x, bool) or not isinstance(x, items):
                    self.refuse(key, f"config field {self.field(key)!r}[{i}] = {x!r} is not "
                                     f"a {'string' if items is str else 'whole number'}")
        return v


# -- node constructors ---------------------------------------------------------------------
# Linear nodes carry two private keys, stripped before output:
#   _mods: tuple of shards; each shard is a tuple of alias module names relative to the layer
#          prefix (or absolute for the head), used to match quantisation ignore/target lists;
#   _cls:  "linear", "experts" or "router" (D34 / D36 dtype classes).

def _ew(role: str, bytes_per_token: int | None = None) -> dict:
    node = {"op": "Elementwise", "role": role}
    if bytes_per_token is not None:
        node["bytes_per_token"] = int(bytes_per_token)
    return node


def _gemm(role: str, n: int, k: int, mods: Sequence, cls: str = "linear") -> dict:
    shards = tuple((m,) if isinstance(m, str) else tuple(m) for m in mods)
    return {"op": "GEMM", "role": role, "n": int(n), "k": int(k), "_mods": shards, "_cls": cls}


def _attention(kind: str, n_q: int, n_kv: int, d_h: int, *, role: str | None = None,
               **extra: int | None) -> dict:
    node: dict[str, Any] = {"op": "Attention"}
    if role:
        node["role"] = role
    node.update({"kind": kind, "n_q": int(n_q), "n_kv": int(n_kv), "d_h": int(d_h)})
    for key in ("window", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                "index_topk", "compress_ratio"):
        if extra.get(key) is not None:
            node[key] = int(extra[key])
    return node


def _allreduce(role: str, emit: str) -> dict:
    return {"op": "AllReduce", "role": role, "emit": emit}


def _all2all() -> dict:
    return {"op": "All2All", "role": "moe_dispatch_combine", "emit": "expert_parallel"}


def _qk_norms(n_q: int, n_kv: int, d_h: int) -> list[dict]:
    # D36: q_norm / k_norm are launched kernels. bytes_per_token = read + write of the bf16
    # per-token q (resp. k) activations: 2 (read, write) · 2 B · width, width = n_q·d_h
    # (resp. n_kv·d_h), unsharded.
    return [_ew("q_norm", 2 * 2 * n_q * d_h), _ew("k_norm", 2 * 2 * n_kv * d_h)]


# -- the shared building blocks -------------------------------------------------------------

class _Moe:
    """Routed-expert block parameters (documents.md §6.3 GroupedGEMM)."""

    def __init__(self, *, experts: int, top_k: int, n: int, shared: int = 0,
                 shared_inter: int | None = None, latent: int | None = None,
                 router_mods: Sequence, expert_mods: Sequence,
                 latent_mods: tuple[Sequence, Sequence] = ((), ())):
        self.experts, self.top_k, self.n = experts, top_k, n
        self.shared, self.shared_inter, self.latent = shared, shared_inter, latent
        self.router_mods, self.expert_mods, self.latent_mods = router_mods, expert_mods, latent_mods


def _moe_nodes(H: int, moe: _Moe) -> list[dict]:
    # D36: the router GEMM (n = experts, k = hidden, at torch_dtype) precedes the experts.
    nodes = [_gemm("router", moe.experts, H, moe.router_mods, cls="router")]
    if moe.latent:
        # §6.7: a latent MoE has explicit down/up GEMMs around the routed experts.
        nodes.append(_gemm("moe_latent_down", moe.latent, H, moe.latent_mods[0]))
    g: dict[str, Any] = {"op": "GroupedGEMM", "role": "experts", "n": moe.n, "k": H,
                         "experts": moe.experts, "top_k": moe.top_k}
    if moe.shared:
        g["shared_experts"] = moe.shared
        if moe.shared_inter is not None and moe.shared_inter != moe.n:
            g["shared_intermediate_size"] = moe.shared_inter
    if moe.latent:
        g["latent_size"] = moe.latent
    # One node carries one weight_dtype: it is the routed experts' (the bulk of the weights);
    # where a checkpoint leaves the shared experts unquantised (Kimi-K2.5/K3 ignore lists) the
    # shared experts are priced at the routed dtype too.
    g["_mods"] = (tuple(moe.expert_mods),)
    g["_cls"] = "experts"
    nodes.append(g)
    nodes.append(_all2all())
    if moe.latent:
        nodes.append(_gemm("moe_latent_up", H, moe.latent, moe.latent_mods[1]))
    nodes.append(_allreduce("mlp_out", "tensor_parallel_unless_sp_moe"))
    return nodes


def _dense_mlp_nodes(H: int, inter: int, mods: tuple[Sequence, Sequence],
                     gated: bool = True) -> list[dict]:
    if gated:
        first = _gemm("mlp_gate_up", 2 * inter, H, mods[0])
    else:
        first = _gemm("mlp_up", inter, H, mods[0])
    return [first, _gemm("mlp_down", H, inter, mods[1]),
            _allreduce("mlp_out", "tensor_parallel_unless_sp_moe")]


def _ffn_nodes(H: int, is_moe: bool, moe: "_Moe | None", inter: int | None
               ) -> tuple[str, list[dict]]:
    """A layer's feed-forward part: ``("moe", experts)`` or ``("dense", gated MLP)`` with the
    HF module names ``mlp.gate_proj``/``mlp.up_proj``/``mlp.down_proj``."""
    if is_moe:
        return "moe", _moe_nodes(H, moe)
    return "dense", _dense_mlp_nodes(H, inter, (("mlp.gate_proj", "mlp.up_proj"),
                                                ("mlp.down_proj",)))


_STD_ATTN_MODS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


def _gqa_geometry(c: _Cfg) -> tuple[int, int, int, int]:
    """(hidden, n_q, n_kv, d_h); head_dim = hidden / heads when the config omits it (§6.7)."""
    H = c.int("hidden_size", what="the model width (a positive integer)")
    n_q = c.int("num_attention_heads", what="the query head count (a positive integer)")
    # spec silent; vLLM v0.31.0: an absent num_key_value_heads means multi-head attention
    # (HF config default num_key_value_heads = num_attention_heads).
    n_kv = c.int("num_key_value_heads", n_q)
    if n_kv > n_q:
        c.refuse("num_key_value_heads", f"num_key_value_heads = {n_kv} exceeds "
                                        f"num_attention_heads = {n_q}")
    d_h = c.int("head_dim", None)
    if d_h is None:
        if H % n_q:
            c.refuse("head_dim", f"head_dim is absent and hidden_size {H} is not divisible by "
                                 f"num_attention_heads {n_q}")
        d_h = H // n_q
    return H, n_q, n_kv, d_h


def _std_attention_nodes(H: int, n_q: int, n_kv: int, d_h: int, *, kind: str = "gqa",
                         window: int | None = None, qk_norm: bool = False,
                         out_gate: bool = False, prefix: str = "self_attn",
                         indexer: list[dict] | None = None) -> list[dict]:
    mods = tuple(f"{prefix}.{p}" for p in ("q_proj", "k_proj", "v_proj"))
    # Fused QKV (§6.7): n = (n_q + 2·n_kv)·d_h. A gated-output attention (Qwen3-Next /
    # Qwen3.5 attn_output_gate) projects the gate with q: n = (2·n_q + 2·n_kv)·d_h.
    # spec silent; vLLM v0.31.0: Qwen3NextAttention's qkv_proj emits q_size·(1 + gate) + 2·kv.
    q_width = n_q * d_h * (2 if out_gate else 1)
    nodes = [_ew("input_norm"), _gemm("qkv_proj", q_width + 2 * n_kv * d_h, H, mods)]
    if qk_norm:
        nodes += _qk_norms(n_q, n_kv, d_h)
    if indexer:
        nodes += indexer
    nodes.append(_attention(kind, n_q, n_kv, d_h, window=window))
    nodes += [_gemm("o_proj", H, n_q * d_h, (f"{prefix}.o_proj",)),
              _allreduce("attn_out", "tensor_parallel"), _ew("post_attn_norm")]
    return nodes


def _mla_nodes(c: _Cfg, H: int, *, sparse: bool, out_gate: bool = False) -> list[dict]:
    """MLA projections and attention (§6.7 MLA, D38); DSA indexer when ``sparse``."""
    n_q = c.int("num_attention_heads")
    kv_lora = c.int("kv_lora_rank", what="the MLA latent rank (a positive integer)")
    rope = c.int("qk_rope_head_dim", minimum=0)
    nope = c.int("qk_nope_head_dim", minimum=0)
    v_head = c.int("v_head_dim")
    q_lora = c.int("q_lora_rank", None)
    nodes = [_ew("input_norm")]
    if q_lora:
        nodes += [
            _gemm("qkv_a_proj", q_lora + kv_lora + rope, H,
                  ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
            _ew("q_a_layernorm"), _ew("kv_a_layernorm"),
            _gemm("q_b_proj", n_q * (nope + rope), q_lora, ("self_attn.q_b_proj",)),
        ]
    else:
        nodes += [
            _gemm("q_proj", n_q * (nope + rope), H, ("self_attn.q_proj",)),
            _gemm("kv_a_proj_with_mqa", kv_lora + rope, H, ("self_attn.kv_a_proj_with_mqa",)),
            _ew("kv_a_layernorm"),
        ]
    nodes.append(_gemm("kv_b_proj", n_q * (nope + v_head), kv_lora, ("self_attn.kv_b_proj",)))
    extra: dict[str, Any] = {}
    if sparse:
        idx_heads = c.int("index_n_heads")
        idx_dim = c.int("index_head_dim")
        extra["index_topk"] = c.int("index_topk", what="the DSA top-k (tokens)")
        if not q_lora:
            c.refuse("q_lora_rank", "a sparse-MLA indexer projects its queries from the q-LoRA "
                                    "latent; expected a positive q_lora_rank")
        # spec silent; vLLM v0.31.0: the DeepSeek-V3.2 Indexer runs wq_b (q_lora → heads·dim),
        # wk (hidden → dim), a LayerNorm k_norm and weights_proj (hidden → heads), then scores
        # the cached index keys; the scorer is the role Attention node (§6.7).
        nodes += [
            _gemm("indexer_wq_b", idx_heads * idx_dim, q_lora, ("self_attn.indexer.wq_b",)),
            _gemm("indexer_wk", idx_dim, H, ("self_attn.indexer.wk",)),
            _ew("indexer_k_norm", 2 * 2 * idx_dim),
            _gemm("indexer_weights_proj", idx_heads, H,
                  (("self_attn.indexer.weights_proj", "self_attn.indexers_proj"),)),
            _attention("gqa", idx_heads, 1, idx_dim, role="block_index_scores"),
        ]
    nodes.append(_attention("sparse_mla" if sparse else "mla", n_q, 1, kv_lora + rope,
                            kv_lora_rank=kv_lora, qk_rope_head_dim=rope,
                            qk_nope_head_dim=nope, v_head_dim=v_head, **extra))
    if out_gate:
        # spec silent; vLLM v0.31.0 has no Kimi-K3 MLA; the output gate is priced as one
        # GEMM hidden → n_q·v_head_dim (the width it gates).
        nodes.append(_gemm("attn_gate_proj", n_q * v_head, H, ("self_attn.g_proj",)))
    nodes += [_gemm("o_proj", H, n_q * v_head, ("self_attn.o_proj",)),
              _allreduce("attn_out", "tensor_parallel"), _ew("post_attn_norm")]
    return nodes


def _window_flags(c: _Cfg, L: int) -> list[bool]:
    """Which layers are sliding-window (D35)."""
    if c.bool("use_sliding_window") is False:
        return [False] * L          # D35: use_sliding_window false → no swa layers
    types = c.list("layer_types", L)
    if types is not None:
        flags = []
        for i, t in enumerate(types):
            if t not in ("sliding_attention", "full_attention"):
                c.refuse("layer_types", f"layer_types[{i}] = {t!r} is not understood; expected "
                                        f"'sliding_attention' or 'full_attention'")
            flags.append(t == "sliding_attention")
        return flags
    if not c.has("sliding_window") or c.raw("sliding_window") == 0:
        return [False] * L
    if c.bool("use_sliding_window") is True and c.has("max_window_layers"):
        mwl = c.int("max_window_layers", minimum=0)
        # spec silent; vLLM v0.31.0 (HF Qwen2 layer_types): layers i >= max_window_layers slide.
        return [i >= mwl for i in range(L)]
    # spec silent; vLLM v0.31.0: a sliding_window without per-layer types applies to every layer.
    return [True] * L


def _window(c: _Cfg) -> int:
    return c.int("sliding_window", what="the sliding window (tokens)")


# -- dtype policy (D34) --------------------------------------------------------------------

def _dtype_from_torch(c: _Cfg, outer: _Cfg | None) -> tuple[str | None, str | None]:
    """(graph dtype, config key) of torch_dtype / dtype, text config first."""
    for cfg in (c, outer):
        if cfg is None:
            continue
        for key in ("torch_dtype", "dtype"):
            if cfg.has(key):
                v = cfg.raw(key)
                name = str(v).removeprefix("torch.")
                if name not in _TORCH_DTYPES:
                    cfg.refuse(key, f"{key} = {v!r} is not understood; expected one of "
                                    f"{', '.join(sorted(_TORCH_DTYPES))}")
                return _TORCH_DTYPES[name], cfg.field(key)
    return None, None


def _match_one(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        rx = pattern[3:]
        parts = name.split(".")
        return any(re.match(rx, ".".join(parts[i:])) for i in range(len(parts)))
    if any(ch in pattern for ch in "*?["):
        parts = name.split(".")
        for i in range(len(parts)):
            s = ".".join(parts[i:])
            if fnmatch.fnmatchcase(s, pattern) or fnmatch.fnmatchcase(s, pattern + ".*"):
                return True
        return False
    # A plain module name matches at dotted boundaries ("gate" matches "...moe.gate" but not
    # "...gate_proj"; "model.layers.3.mlp" matches every module under it).
    return f".{pattern}." in f".{name}."


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(_match_one(name, p) for p in patterns)


class _Scheme:
    """The checkpoint's quantisation, resolved to one dtype per linear node (D34)."""

    def __init__(self, torch_dtype: str, global_dtype: str, kind: str, *,
                 default_dtype: str | None = None, ignore: Sequence[str] = (),
                 groups: Sequence[tuple[Sequence[str], str]] = (),
                 layer_algos: Mapping[str, str] | None = None):
        self.torch_dtype = torch_dtype
        self.global_dtype = global_dtype
        self.kind = kind                        # none | uniform | mxfp4 | groups | mixed
        self.default_dtype = default_dtype      # uniform: the quantised dtype
        self.ignore = tuple(ignore)
        self.groups = tuple(groups)             # compressed-tensors (targets, dtype)
        self.layer_algos = dict(layer_algos or {})
        self.file: str | None = None

    def _excluded(self, names: Sequence[str]) -> bool:
        return _matches_any(names, self.ignore)

    def node_dtype(self, cls: str, shards: Sequence[Sequence[str]], where: str) -> tuple[str, bool]:
        """(effective dtype, explicitly not converted) of one linear node."""
        if cls == "router":
            # D36: the router stays at torch_dtype (bf16 when the config states none, D34).
            return self.torch_dtype, True
        if self.kind == "none":
            return self.torch_dtype, False
        results = []
        for aliases in shards:
            results.append(self._shard_dtype(cls, aliases))
        if len(set(results)) > 1:
            raise Refusal("R1", f"the quantisation config treats the fused shards of {where} "
                                f"({', '.join(a[0] for a in shards)}) differently; a fused "
                                f"linear has one weight dtype", field="quantization_config",
                          file=self.file)
        return results[0]

    def _shard_dtype(self, cls: str, aliases: Sequence[str]) -> tuple[str, bool]:
        if self.ignore and self._excluded(aliases):
            return self.torch_dtype, True       # D34: listed as not converted
        if self.kind == "uniform":
            return self.default_dtype, False
        if self.kind == "mxfp4":
            # D34: mxfp4 quantises the expert nodes only; the rest stay at torch_dtype.
            return ("mxfp4", False) if cls == "experts" else (self.torch_dtype, False)
        if self.kind == "groups":
            for targets, dtype in self.groups:
                for t in targets:
                    if t == "Linear" or _matches_any(aliases, (t,)):
                        return dtype, False
            return self.torch_dtype, True       # not targeted by any scheme group
        if self.kind == "mixed":
            for key, dtype in self.layer_algos.items():
                if _matches_any(aliases, (key,)):
                    return dtype, False
            return self.torch_dtype, True
        raise AssertionError(self.kind)


def _matches_any(names: Sequence[str], patterns: Sequence[str]) -> bool:
    return any(_matches(n, patterns) for n in names)


def _compressed_tensors_dtype(q: _Cfg, gname: str, weights: Mapping) -> str:
    bits = weights.get("num_bits")
    typ = weights.get("type")
    group = weights.get("group_size")
    fmt = str(q.raw("format", ""))
    if typ == "int" and bits == 4:
        return "int4"
    if typ == "int" and bits == 8:
        return "int8"
    if typ == "float" and bits == 8:
        return "fp8"
    if typ == "float" and bits == 4:
        if "mxfp4" in fmt or group == 32:
            return "mxfp4"
        if "nvfp4" in fmt or group == 16:
            return "nvfp4"
    q.refuse(f"config_groups.{gname}.weights",
             f"compressed-tensors weight scheme (type {typ!r}, num_bits {bits!r}, group_size "
             f"{group!r}) is not understood; expected int 4/8 or float 4/8 bits")


def _modelopt_dtype(cfg: _Cfg, key: str, algo: Any) -> str:
    if not isinstance(algo, str) or algo not in _MODELOPT_ALGOS:
        cfg.refuse(key, f"ModelOpt quant_algo {algo!r} is not understood; expected one of "
                        f"{', '.join(sorted(_MODELOPT_ALGOS))} or MIXED_PRECISION")
    return _MODELOPT_ALGOS[algo]


def _modelopt_scheme(q: _Cfg, torch_dtype: str) -> _Scheme:
    algo = q.raw("quant_algo")
    if algo is None:
        q.refuse("quant_algo", "ModelOpt quantisation without quant_algo; expected e.g. FP8")
    ignore = (list(q.list("exclude_modules", items=str) or [])
              + list(q.list("ignore", items=str) or []))
    if algo == "MIXED_PRECISION":
        layers = q.sub("quantized_layers")
        if layers is None:
            q.refuse("quantized_layers", "MIXED_PRECISION needs quantized_layers")
        per = {}
        for name, spec in layers.d.items():
            sub = layers.sub(name)
            per[name] = _modelopt_dtype(sub, "quant_algo", spec.get("quant_algo"))
        # spec silent; vLLM v0.31.0 (ModelOpt MIXED_PRECISION) quantises exactly the
        # quantized_layers entries, so there is no single checkpoint dtype: the global dtype is
        # torch_dtype and every quantised node states its own (§6.7 "mixed checkpoints").
        return _Scheme(torch_dtype, torch_dtype, "mixed", ignore=ignore, layer_algos=per)
    dtype = _modelopt_dtype(q, "quant_algo", algo)
    return _Scheme(torch_dtype, dtype, "uniform", default_dtype=dtype, ignore=ignore)


def _resolve_scheme(c: _Cfg, outer: _Cfg | None, quant_config: Mapping | None,
                    file: str | None) -> _Scheme:
    """D34: quantization_config.quant_method first, then torch_dtype, else bf16."""
    torch_dtype, _ = _dtype_from_torch(c, outer)
    base = torch_dtype or "bf16"        # D34: neither quant_method nor torch_dtype → bf16
    q = c.sub("quantization_config") or (outer.sub("quantization_config") if outer else None)
    if q is not None:
        method = q.raw("quant_method")
        if method == "fp8":
            ignore = list(q.list("modules_to_not_convert", items=str) or []) + \
                list(q.list("ignored_layers", items=str) or [])
            return _Scheme(base, "fp8", "uniform", default_dtype="fp8", ignore=ignore)
        if method == "mxfp4":
            ignore = q.list("modules_to_not_convert", items=str) or []
            return _Scheme(base, base, "mxfp4", ignore=ignore)
        if method == "compressed-tensors":
            groups_cfg = q.sub("config_groups")
            if groups_cfg is None or not groups_cfg.d:
                q.refuse("config_groups", "compressed-tensors without config_groups; expected "
                                          "at least one weight scheme group")
            groups = []
            for gname, g in groups_cfg.d.items():
                gcfg = groups_cfg.sub(gname)
                weights = g.get("weights")
                if not isinstance(weights, Mapping):
                    gcfg.refuse("weights", "a compressed-tensors group without a weight scheme "
                                           "is not understood (activation-only quantisation)")
                targets = gcfg.list("targets", items=str) or []
                groups.append((targets, _compressed_tensors_dtype(q, gname, weights)))
            ignore = q.list("ignore", items=str) or []
            return _Scheme(base, groups[0][1], "groups", ignore=ignore, groups=groups)
        if method == "modelopt" or (method is None and q.has("quant_algo")):
            # spec silent; vLLM v0.31.0 recognises a ModelOpt checkpoint by quant_algo (the
            # producer block says modelopt) even where quant_method is not written.
            return _modelopt_scheme(q, base)
        q.refuse("quant_method", f"quant_method {method!r} is not understood; expected fp8, "
                                 f"mxfp4, compressed-tensors or modelopt")
    if quant_config is not None:
        qc = _Cfg(quant_config, "hf_quant_config.", file)
        qq = qc.sub("quantization")
        if qq is None:
            qc.refuse("quantization", "hf_quant_config.json has no 'quantization' object")
        return _modelopt_scheme(qq, base)
    return _Scheme(base, base, "none")


# -- layer plans ----------------------------------------------------------------------------

class _Layer:
    """One decoder layer: a kind-naming tag and its node list (with private keys)."""

    def __init__(self, tag: str, nodes: list[dict]):
        self.tag = tag
        self.nodes = nodes


class _Plan:
    def __init__(self, *, H: int, V: int, layers: list[_Layer], layer_prefix: str,
                 head_prefix: str, speculator: dict | None = None):
        self.H, self.V, self.layers = H, V, layers
        self.layer_prefix, self.head_prefix = layer_prefix, head_prefix
        self.speculator = speculator    # {"method", "repeat", "pattern_layers": [layer index]}


def _layers_count(c: _Cfg) -> int:
    return c.int("num_hidden_layers", what="the decoder layer count (a positive integer)",
                 limit="MAX_LAYERS")


def _vocab(c: _Cfg) -> int:
    return c.int("vocab_size", what="the vocabulary size (a positive integer)")


def _mtp_speculator(c: _Cfg, method: str | None, L: int, *, keys=("num_nextn_predict_layers",),
                    repeat_key: str | None = None) -> dict | None:
    # §6.7: MTP layers are announced by num_nextn_predict_layers (mtp_num_hidden_layers for
    # the Qwen3-Next family). MiniMax-M2's use_mtp / num_mtp_modules is not such a field, and
    # §7 lists minimax-m2.5 without a speculator.
    n = 0
    key_used = keys[0]
    for key in keys:
        if c.has(key):
            n = c.int(key, minimum=0, limit="MAX_LAYERS")
            key_used = key
            break
    if n <= 0:
        return None
    if method is None:
        c.refuse(key_used, f"{key_used} = {n} but no MTP speculator method is known for "
                           f"model_type {c.raw('model_type')!r}")
    repeat = (c.int(repeat_key, limit="MAX_LAYERS") if repeat_key and c.has(repeat_key)
              else n)
    # The MTP block is one more decoder layer of the main stack's last kind (§6.7 example:
    # deepseek_mtp over attn_moe).
    return {"method": method, "repeat": repeat, "pattern_layers": [L - 1]}


def _plan_dense_family(c: _Cfg, model_type: str) -> _Plan:
    """llama / mistral / qwen2 / qwen3 and their MoE siblings (mixtral, qwen3_moe, gpt_oss,
    minimax_m2)."""
    H, n_q, n_kv, d_h = _gqa_geometry(c)
    L = _layers_count(c)
    V = _vocab(c)
    windowed = _window_flags(c, L)
    window = _window(c) if any(windowed) else None
    qk_norm = model_type in ("qwen3", "qwen3_moe", "qwen3_vl_text", "qwen3_vl_moe_text")
    if model_type == "minimax_m2":
        qk_norm = bool(c.bool("use_qk_norm", False))
        if qk_norm and c.raw("qk_norm_type", "per_layer") not in ("per_layer", "per_head"):
            c.refuse("qk_norm_type", f"qk_norm_type {c.raw('qk_norm_type')!r} is not "
                                     f"understood; expected per_layer or per_head")
    moe_layers = [False] * L
    moe = None
    if model_type in ("mixtral", "gpt_oss", "minimax_m2"):
        experts = c.int_any(("num_local_experts", "num_experts"), what="the routed expert count")
        top_k = c.int_any(("num_experts_per_tok", "experts_per_token"),
                          what="experts per token")
        n = c.int("intermediate_size", what="the per-expert intermediate size")
        shared = 0
        if model_type == "minimax_m2" and c.int("shared_intermediate_size", 0, minimum=0) > 0:
            shared = 1
        block = {"mixtral": "block_sparse_moe", "minimax_m2": "block_sparse_moe",
                 "gpt_oss": "mlp"}[model_type]
        router = f"{block}.router" if model_type == "gpt_oss" else f"{block}.gate"
        moe = _Moe(experts=experts, top_k=top_k, n=n, shared=shared,
                   shared_inter=c.int("shared_intermediate_size", None) if shared else None,
                   router_mods=(router,),
                   expert_mods=(f"{block}.experts", f"{block}.experts.0.w1"))
        moe_layers = [True] * L
    elif model_type in ("qwen3_moe", "qwen3_vl_moe_text"):
        experts = c.int("num_experts", what="the routed expert count")
        top_k = c.int("num_experts_per_tok", what="experts per token")
        n = c.int("moe_intermediate_size", what="the per-expert intermediate size")
        step = c.int("decoder_sparse_step", 1)
        only = set(c.list("mlp_only_layers", items=int) or [])
        # spec silent; vLLM v0.31.0 Qwen3MoeDecoderLayer: MoE iff the layer is not in
        # mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
        moe_layers = [(i not in only) and (i + 1) % step == 0 for i in range(L)]
        shared_inter = c.int("shared_expert_intermediate_size", 0, minimum=0)
        moe = _Moe(experts=experts, top_k=top_k, n=n, shared=1 if shared_inter else 0,
                   shared_inter=shared_inter or None, router_mods=("mlp.gate",),
                   expert_mods=("mlp.experts", "mlp.experts.0.gate_proj"))
    inter = None
    if not all(moe_layers):
        inter = c.int("intermediate_size", what="the dense MLP intermediate size")
    layers = []
    any_swa = any(windowed)
    for i in range(L):
        kind = "swa" if windowed[i] else "gqa"
        nodes = _std_attention_nodes(H, n_q, n_kv, d_h, kind=kind,
                                     window=window if windowed[i] else None, qk_norm=qk_norm)
        ffn, ffn_nodes = _ffn_nodes(H, moe_layers[i], moe, inter)
        nodes += ffn_nodes
        mixer = "swa" if windowed[i] else ("full" if any_swa else "attn")
        layers.append(_Layer(f"{mixer}_{ffn}", nodes))
    return _Plan(H=H, V=V, layers=layers, layer_prefix="model.layers.{i}.",
                 head_prefix="")


def _plan_llama4(c: _Cfg) -> _Plan:
    H, n_q, n_kv, d_h = _gqa_geometry(c)
    L = _layers_count(c)
    V = _vocab(c)
    step = c.int("interleave_moe_layer_step", 1, minimum=0)
    experts = c.int("num_local_experts", what="the routed expert count")
    top_k = c.int("num_experts_per_tok")
    n = c.int("intermediate_size", what="the per-expert intermediate size")
    # spec silent; vLLM v0.31.0 Llama4MoE: every MoE layer also runs one shared expert of
    # intermediate_size (SharedFusedMoE with a Llama4MLP shared_expert).
    moe = _Moe(experts=experts, top_k=top_k, n=n, shared=1, shared_inter=n,
               router_mods=("feed_forward.router",),
               expert_mods=("feed_forward.experts", "feed_forward.experts.gate_up_proj"),)
    # spec silent; vLLM v0.31.0 reads the config through HF Llama4TextConfig, which takes an
    # empty no_rope_layers list as absent (no model has zero layers) and falls back to the
    # interval rule below; compressed checkpoints such as RedHatAI's FP8-dynamic Scout ship
    # "no_rope_layers": [].
    no_rope = c.list("no_rope_layers", L) if c.list("no_rope_layers") else None
    if no_rope is None:
        interval = c.int("no_rope_layer_interval", 4)
        # spec silent; vLLM v0.31.0 (HF Llama4TextConfig default): layer i uses RoPE iff
        # (i + 1) % no_rope_layer_interval != 0.
        no_rope = [int((i + 1) % interval != 0) for i in range(L)]
    use_qk = bool(c.bool("use_qk_norm", False))
    dense_inter = None
    layers = []
    for i in range(L):
        rope = bool(no_rope[i])
        # spec silent; vLLM v0.31.0 Llama4Attention: the (weightless L2) qk norm runs only on
        # RoPE layers; chunked local attention (attention_chunk_size) has no graph kind and is
        # priced as full gqa (§7 lists Llama-4 Scout as gqa).
        nodes = _std_attention_nodes(H, n_q, n_kv, d_h, qk_norm=use_qk and rope)
        # spec silent; vLLM v0.31.0 Llama4DecoderLayer: MoE iff (i + 1) % step == 0.
        is_moe = step > 0 and (i + 1) % step == 0
        if is_moe:
            nodes += _moe_nodes(H, moe)
            ffn = "moe"
        else:
            if dense_inter is None:
                dense_inter = c.int("intermediate_size_mlp", what="the dense MLP size")
            nodes += _dense_mlp_nodes(H, dense_inter, (("feed_forward.gate_proj",
                                                         "feed_forward.up_proj"),
                                                        ("feed_forward.down_proj",)))
            ffn = "dense"
        layers.append(_Layer(f"{'attn' if rope else 'nope'}_{ffn}", nodes))
    return _Plan(H=H, V=V, layers=layers, layer_prefix="language_model.model.layers.{i}.",
                 head_prefix="language_model.")


_DEEPSEEK_MTP = {"deepseek_v2": "deepseek_mtp", "deepseek_v3": "deepseek_mtp",
                 "deepseek_v32": "deepseek_mtp", "kimi_k2": "deepseek_mtp",
                 # spec silent; vLLM v0.31.0: GLM-5 (glm_moe_dsa) MTP runs as deepseek_mtp
                 # (§7 lists glm-5.2 with deepseek_mtp).
                 "glm_moe_dsa": "deepseek_mtp"}


def _deepseek_moe_layers(c: _Cfg, L: int, experts_key: str) -> list[bool]:
    first = c.int("first_k_dense_replace", 0, minimum=0)
    freq = c.int("moe_layer_freq", 1)
    has_experts = c.has(experts_key)
    # spec silent; vLLM v0.31.0 DeepseekV2DecoderLayer: MoE iff experts exist,
    # i >= first_k_dense_replace and i % moe_layer_freq == 0.
    return [has_experts and i >= first and i % freq == 0 for i in range(L)]


def _plan_deepseek(c: _Cfg, model_type: str) -> _Plan:
    H = c.int("hidden_size", what="the model width (a positive integer)")
    L = _layers_count(c)
    V = _vocab(c)
    sparse = model_type in ("deepseek_v32", "glm_moe_dsa")
    if sparse and not c.has("index_topk"):
        c.refuse("index_topk", f"model_type {model_type!r} is a sparse-attention (DSA) model "
                               f"but index_topk is missing; expected the top-k in tokens")
    moe_layers = _deepseek_moe_layers(c, L, "n_routed_experts")
    moe = None
    if any(moe_layers):
        n = c.int("moe_intermediate_size", what="the per-expert intermediate size")
        shared = c.int("n_shared_experts", 0, minimum=0)
        moe = _Moe(experts=c.int("n_routed_experts"), top_k=c.int("num_experts_per_tok"),
                   n=n, shared=shared, shared_inter=n, router_mods=("mlp.gate",),
                   expert_mods=("mlp.experts", "mlp.experts.0.gate_proj"))
    inter = c.int("intermediate_size") if not all(moe_layers) else None
    attn = _mla_nodes(c, H, sparse=sparse)
    layers = []
    for i in range(L):
        nodes = [dict(n) for n in attn]
        ffn, ffn_nodes = _ffn_nodes(H, moe_layers[i], moe, inter)
        nodes += ffn_nodes
        layers.append(_Layer(f"attn_{ffn}", nodes))
    spec = _mtp_speculator(c, _DEEPSEEK_MTP.get(model_type), L)
    return _Plan(H=H, V=V, layers=layers, layer_prefix="model.layers.{i}.", head_prefix="",
                 speculator=spec)


_NEMOTRON_TYPES = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


def _nemotron_types(c: _Cfg, L: int, pattern_key: str, list_key: str) -> list[str] | None:
    if c.has(pattern_key):
        pat = str(c.raw(pattern_key))
        if len(pat) != L:
            c.refuse(pattern_key, f"{pattern_key} has {len(pat)} layers; num_hidden_layers "
                                  f"is {L}")
        out = []
        for ch in pat:
            if ch not in _NEMOTRON_TYPES:
                c.refuse(pattern_key, f"layer type {ch!r} in {pattern_key} is not understood; "
                                      f"expected one of M (mamba2), E (MoE), * (attention), "
                                      f"- (MLP)")
            out.append(_NEMOTRON_TYPES[ch])
        return out
    lst = c.list(list_key, L)
    if lst is not None:
        for t in lst:
            if t not in _NEMOTRON_TYPES.values():
                c.refuse(list_key, f"layer type {t!r} in {list_key} is not understood; "
                                   f"expected mamba, moe, attention or mlp")
        return list(lst)
    return None


def _plan_nemotron_h(c: _Cfg) -> _Plan:
    H, n_q, n_kv, d_h = _gqa_geometry(c)
    if c.has("num_hidden_layers"):
        L = _layers_count(c)
    elif c.has("hybrid_override_pattern"):
        # spec silent; vLLM v0.31.0 (transformers NemotronHConfig): the layer count is the
        # length of the per-layer type list when num_hidden_layers is not stated.
        L = len(str(c.raw("hybrid_override_pattern")))
    elif c.has("layers_block_type"):
        L = len(c.list("layers_block_type"))
    else:
        L = _layers_count(c)
    if L > _limits.MAX_LAYERS:
        c.refuse("hybrid_override_pattern" if c.has("hybrid_override_pattern")
                 else "layers_block_type", f"{L:,} layers: {_limits.beyond('MAX_LAYERS', L)}")
    V = _vocab(c)
    types = _nemotron_types(c, L, "hybrid_override_pattern", "layers_block_type")
    if types is None:
        c.refuse("hybrid_override_pattern", "a nemotron_h config needs hybrid_override_pattern "
                                            "or layers_block_type (one entry per layer)")
    state_dtype = None
    if c.has("mamba_ssm_cache_dtype"):
        sd = str(c.raw("mamba_ssm_cache_dtype")).removeprefix("torch.")
        if sd not in _TORCH_DTYPES:
            c.refuse("mamba_ssm_cache_dtype", f"{sd!r} is not understood")
        state_dtype = _TORCH_DTYPES[sd]
    kinds: dict[str, list[dict]] = {}
    pre = "mixer"
    if "mamba" in types:
        heads = c.int("mamba_num_heads")
        head_dim = c.int("mamba_head_dim")
        S = c.int("ssm_state_size")
        G = c.int("n_groups")
        conv = c.int("conv_kernel")
        inner = heads * head_dim
        rec: dict[str, Any] = {"op": "RecurrentUpdate", "recurrent_kind": "mamba2",
                               "n_heads": heads, "state_size": S, "n_groups": G,
                               "conv_kernel": conv, "intermediate_size": inner}
        if state_dtype:
            rec["state_dtype"] = state_dtype
        # spec silent; vLLM v0.31.0 MambaMixer2: in_proj emits gate z (inner), x (inner),
        # B and C (n_groups·state each) and dt (heads): n = 2·inner + 2·G·S + heads.
        kinds["mamba"] = [_ew("input_norm"),
                          _gemm("mixer_in_proj", 2 * inner + 2 * G * S + heads, H,
                                (f"{pre}.in_proj",)),
                          rec,
                          _gemm("mixer_out", H, inner, (f"{pre}.out_proj",)),
                          _allreduce("attn_out", "tensor_parallel")]
    if "attention" in types:
        mods = tuple(f"{pre}.{p}" for p in ("q_proj", "k_proj", "v_proj"))
        kinds["attention"] = [_ew("input_norm"),
                              _gemm("qkv_proj", (n_q + 2 * n_kv) * d_h, H, mods),
                              _attention("gqa", n_q, n_kv, d_h),
                              _gemm("o_proj", H, n_q * d_h, (f"{pre}.o_proj",)),
                              _allreduce("attn_out", "tensor_parallel")]
    if "moe" in types:
        n = c.int("moe_intermediate_size", what="the per-expert intermediate size")
        latent = c.int("moe_latent_size", None)
        moe = _Moe(experts=c.int("n_routed_experts"), top_k=c.int("num_experts_per_tok"),
                   n=n, shared=c.int("n_shared_experts", 0, minimum=0),
                   shared_inter=c.int("moe_shared_expert_intermediate_size", None),
                   latent=latent, router_mods=(f"{pre}.gate",),
                   expert_mods=(f"{pre}.experts", f"{pre}.experts.0.up_proj"),
                   latent_mods=((f"{pre}.fc1_latent_proj",), (f"{pre}.fc2_latent_proj",)))
        kinds["moe"] = [_ew("input_norm")] + _moe_nodes(H, moe)
    if "mlp" in types:
        inter = c.int("intermediate_size")
        # spec silent; vLLM v0.31.0 NemotronHMLP: a relu2 MLP is up_proj → relu² → down_proj
        # with no gate, so its first GEMM is mlp_up with n = intermediate_size (not 2·).
        gated = c.raw("mlp_hidden_act", "relu2") != "relu2"
        kinds["mlp"] = [_ew("input_norm")] + _dense_mlp_nodes(
            H, inter, ((f"{pre}.gate_proj", f"{pre}.up_proj") if gated else (f"{pre}.up_proj",),
                       (f"{pre}.down_proj",)), gated=gated)
    layers = [_Layer(t, [dict(n) for n in kinds[t]]) for t in types]
    spec = None
    n_mtp = c.int("num_nextn_predict_layers", 0, minimum=0, limit="MAX_LAYERS")
    if n_mtp > 0:
        if c.has("mtp_hybrid_override_pattern"):
            key = "mtp_hybrid_override_pattern"
            mtp = _nemotron_types(c, len(str(c.raw(key))), key, "")
        elif c.has("mtp_layers_block_type"):
            key = "mtp_layers_block_type"
            mtp = _nemotron_types(c, len(c.list(key)), "", key)
        else:
            c.refuse("num_nextn_predict_layers", "num_nextn_predict_layers > 0 but neither "
                     "mtp_hybrid_override_pattern nor mtp_layers_block_type states the MTP "
                     "layer types")
        idx = []
        for t in mtp:
            if t not in types:
                c.refuse(key, f"MTP layer type {t!r} has no layer of that type in the main "
                              f"stack, so its kind is not declared")
            idx.append(types.index(t))
        spec = {"method": "nemotron_h_mtp", "repeat": n_mtp, "pattern_layers": idx}
    return _Plan(H=H, V=V, layers=layers, layer_prefix="backbone.layers.{i}.", head_prefix="",
                 speculator=spec)


def _plan_qwen_hybrid(c: _Cfg, model_type: str) -> _Plan:
    """Qwen3-Next / Qwen3.5: gated delta net (gdn) layers + gated full attention."""
    H, n_q, n_kv, d_h = _gqa_geometry(c)
    L = _layers_count(c)
    V = _vocab(c)
    types = c.list("layer_types", L)
    if types is None:
        interval = c.int("full_attention_interval", what="the full-attention interval")
        # spec silent; vLLM v0.31.0 Qwen3Next: layer i is full attention iff
        # (i + 1) % full_attention_interval == 0, else linear attention.
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(L)]
    for i, t in enumerate(types):
        if t not in ("full_attention", "linear_attention"):
            c.refuse("layer_types", f"layer_types[{i}] = {t!r} is not understood; expected "
                                    f"'full_attention' or 'linear_attention'")
    out_gate = bool(c.bool("attn_output_gate", True if model_type == "qwen3_next" else False))
    kh = c.int("linear_num_key_heads")
    vh = c.int("linear_num_value_heads")
    kd = c.int("linear_key_head_dim")
    vd = c.int("linear_value_head_dim")
    conv = c.int("linear_conv_kernel_dim")
    key_dim, value_dim = kh * kd, vh * vd
    rec: dict[str, Any] = {"op": "RecurrentUpdate", "recurrent_kind": "gdn", "n_heads": vh,
                           "state_size": kd, "conv_kernel": conv,
                           "intermediate_size": 2 * key_dim + value_dim}
    if c.has("mamba_ssm_dtype"):
        sd = str(c.raw("mamba_ssm_dtype")).removeprefix("torch.")
        if sd not in _TORCH_DTYPES:
            c.refuse("mamba_ssm_dtype", f"{sd!r} is not understood")
        rec["state_dtype"] = _TORCH_DTYPES[sd]
    # spec silent; vLLM v0.31.0 Qwen3NextGatedDeltaNet: two merged column-parallel linears,
    # in_proj_qkvz (q, k: key_dim each; v, z: value_dim each) and in_proj_ba (b, a: one per
    # value head); the conv runs over q, k, v (2·key_dim + value_dim channels); out_proj
    # value_dim → hidden.
    gdn = [_ew("input_norm"),
           _gemm("mixer_in_proj_qkvz", 2 * key_dim + 2 * value_dim, H,
                 (("linear_attn.in_proj_qkvz", "linear_attn.in_proj_qkv"),
                  ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_z"))),
           _gemm("mixer_in_proj_ba", 2 * vh, H,
                 (("linear_attn.in_proj_ba", "linear_attn.in_proj_b"),
                  ("linear_attn.in_proj_ba", "linear_attn.in_proj_a"))),
           rec,
           _gemm("mixer_out", H, value_dim, ("linear_attn.out_proj",)),
           _allreduce("attn_out", "tensor_parallel"), _ew("post_attn_norm")]
    attn = _std_attention_nodes(H, n_q, n_kv, d_h, qk_norm=True, out_gate=out_gate)
    experts = c.int("num_experts", 0, minimum=0)
    moe = None
    if experts:
        step = c.int("decoder_sparse_step", 1)
        only = set(c.list("mlp_only_layers", items=int) or [])
        moe_layers = [(i not in only) and (i + 1) % step == 0 for i in range(L)]
        shared_inter = c.int("shared_expert_intermediate_size", 0, minimum=0)
        moe = _Moe(experts=experts, top_k=c.int("num_experts_per_tok"),
                   n=c.int("moe_intermediate_size"), shared=1 if shared_inter else 0,
                   shared_inter=shared_inter or None, router_mods=("mlp.gate",),
                   expert_mods=("mlp.experts", "mlp.experts.0.gate_proj"))
    else:
        moe_layers = [False] * L
    inter = c.int("intermediate_size") if not all(moe_layers) else None
    layers = []
    for i in range(L):
        mixer, nodes = ("attn", [dict(n) for n in attn]) if types[i] == "full_attention" \
            else ("gdn", [dict(n) for n in gdn])
        ffn, ffn_nodes = _ffn_nodes(H, moe_layers[i], moe, inter)
        nodes += ffn_nodes
        layers.append(_Layer(f"{mixer}_{ffn}", nodes))
    method = "qwen3_next_mtp" if model_type == "qwen3_next" else "qwen3_5_mtp"
    spec = _mtp_speculator(c, method, L, keys=("mtp_num_hidden_layers",
                                               "num_nextn_predict_layers"))
    return _Plan(H=H, V=V, layers=layers, layer_prefix="model.language_model.layers.{i}.",
                 head_prefix="", speculator=spec)


def _plan_kimi_linear(c: _Cfg) -> _Plan:
    """Kimi-Linear / Kimi-K3: KDA recurrent layers + MLA full-attention layers."""
    H = c.int("hidden_size")
    L = _layers_count(c)
    V = _vocab(c)
    la = c.sub("linear_attn_config")
    if la is None:
        c.refuse("linear_attn_config", "a kimi_linear config needs linear_attn_config")
    kda_layers = set(la.list("kda_layers", items=int) or [])
    full_layers = set(la.list("full_attn_layers", items=int) or [])
    # spec silent; vLLM v0.31.0 KimiLinearConfig.is_kda_layer: the lists are 1-based.
    types = []
    for i in range(L):
        if (i + 1) in kda_layers:
            types.append("kda")
        elif (i + 1) in full_layers:
            types.append("mla")
        else:
            la.refuse("kda_layers", f"layer {i + 1} (1-based) is in neither kda_layers nor "
                                    f"full_attn_layers")
    heads = la.int("num_heads")
    hd = la.int("head_dim")
    conv = la.int("short_conv_kernel_size")
    full_rank = bool(la.bool("use_full_rank_gate", False))
    # spec silent; vLLM v0.31.0 KimiDeltaAttention: q, k, v (heads·head_dim each) and b
    # (heads) from the hidden state; the forget gate f and output gate g are low-rank
    # (hidden → head_dim → heads·head_dim) unless use_full_rank_gate
    # (hidden → heads·head_dim).
    in_n = 3 * heads * hd + heads + (2 * heads * hd if full_rank else 2 * hd)
    kda = [_ew("input_norm"),
           _gemm("mixer_in_proj", in_n, H, (("self_attn.q_proj",), ("self_attn.k_proj",),
                                             ("self_attn.v_proj",), ("self_attn.b_proj",)))]
    if not full_rank:
        kda += [_gemm("mixer_f_b_proj", heads * hd, hd, ("self_attn.f_b_proj",)),
                _gemm("mixer_g_b_proj", heads * hd, hd, ("self_attn.g_b_proj",))]
    kda += [{"op": "RecurrentUpdate", "recurrent_kind": "kda", "n_heads": heads,
             "state_size": hd, "conv_kernel": conv, "intermediate_size": 3 * heads * hd},
            _gemm("mixer_out", H, heads * hd, ("self_attn.o_proj",)),
            _allreduce("attn_out", "tensor_parallel"), _ew("post_attn_norm")]
    mla = _mla_nodes(c, H, sparse=False, out_gate=bool(c.bool("mla_use_output_gate", False)))
    moe_layers = _deepseek_moe_layers(c, L, "num_experts")
    moe = None
    if any(moe_layers):
        latent = c.int("routed_expert_hidden_size", None)
        if latent == H:
            latent = None
        moe = _Moe(experts=c.int("num_experts"), top_k=c.int_any(("num_experts_per_token",
                                                                  "num_experts_per_tok")),
                   n=c.int("moe_intermediate_size"),
                   shared=c.int("num_shared_experts", 0, minimum=0),
                   shared_inter=c.int("moe_intermediate_size"), latent=latent,
                   router_mods=("mlp.gate",),
                   expert_mods=("mlp.experts", "mlp.experts.0.gate_proj"),
                   latent_mods=(("mlp.latent_down_proj",), ("mlp.latent_up_proj",)))
    inter = c.int("intermediate_size") if not all(moe_layers) else None
    layers = []
    for i in range(L):
        nodes = [dict(n) for n in (kda if types[i] == "kda" else mla)]
        ffn, ffn_nodes = _ffn_nodes(H, moe_layers[i], moe, inter)
        nodes += ffn_nodes
        layers.append(_Layer(f"{types[i]}_{ffn}", nodes))
    spec = _mtp_speculator(c, None, L)
    return _Plan(H=H, V=V, layers=layers, layer_prefix="language_model.model.layers.{i}.",
                 head_prefix="language_model.", speculator=spec)


def _plan_minimax_m3(c: _Cfg) -> _Plan:
    H, n_q, n_kv, d_h = _gqa_geometry(c)
    L = _layers_count(c)
    V = _vocab(c)
    qk_norm = bool(c.bool("use_qk_norm", False))
    if qk_norm and c.raw("qk_norm_type", "per_head") not in ("per_layer", "per_head"):
        c.refuse("qk_norm_type", f"qk_norm_type {c.raw('qk_norm_type')!r} is not understood")
    sa = c.sub("sparse_attention_config")
    sparse = [False] * L
    if sa is not None and sa.bool("use_sparse_attention", False):
        freq = sa.list("sparse_attention_freq", L)
        if freq is None:
            sa.refuse("sparse_attention_freq", "use_sparse_attention needs a per-layer "
                                               "sparse_attention_freq list")
        sparse = [bool(f) for f in freq]
    indexer = window = None
    if any(sparse):
        idx_heads = sa.int("sparse_num_index_heads")
        idx_dim = sa.int("sparse_index_dim")
        block = sa.int("sparse_block_size")
        # spec silent (§7: swa window 2176 + indexer gqa 4/1/128); the attended span per query
        # is (init + local + top-k) blocks of sparse_block_size tokens.
        window = (sa.int("sparse_init_block", 0, minimum=0) + sa.int("sparse_local_block", 0,
                                                                     minimum=0)
                  + sa.int("sparse_topk_blocks")) * block
        indexer = [_gemm("indexer_qk_proj", (idx_heads + 1) * idx_dim, H,
                         ("self_attn.indexer.qk_proj",)),
                   _attention("gqa", idx_heads, 1, idx_dim, role="block_index_scores")]
    freq = c.list("moe_layer_freq", L)
    first = c.int("first_k_dense_replace", 0, minimum=0)
    moe_layers = [bool(f) for f in freq] if freq is not None else [i >= first for i in range(L)]
    moe = None
    if any(moe_layers):
        n = c.int("moe_intermediate_size")
        moe = _Moe(experts=c.int("num_local_experts"), top_k=c.int("num_experts_per_tok"), n=n,
                   shared=c.int("n_shared_experts", 0, minimum=0),
                   shared_inter=c.int("shared_intermediate_size", None),
                   router_mods=("block_sparse_moe.gate",),
                   expert_mods=("block_sparse_moe.experts", "block_sparse_moe.experts.0.w1"))
    inter = c.int_any(("dense_intermediate_size", "intermediate_size")) \
        if not all(moe_layers) else None
    layers = []
    for i in range(L):
        if sparse[i]:
            nodes = _std_attention_nodes(H, n_q, n_kv, d_h, kind="swa", window=window,
                                         qk_norm=qk_norm, indexer=[dict(n) for n in indexer])
            mixer = "sparse_attn"
        else:
            nodes = _std_attention_nodes(H, n_q, n_kv, d_h, qk_norm=qk_norm)
            mixer = "attn"
        ffn, ffn_nodes = _ffn_nodes(H, moe_layers[i], moe, inter)
        nodes += ffn_nodes
        layers.append(_Layer(f"{mixer}_{ffn}", nodes))
    spec = _mtp_speculator(c, "minimax_m3_mtp", L, repeat_key="num_mtp_modules")
    return _Plan(H=H, V=V, layers=layers, layer_prefix="model.layers.{i}.", head_prefix="",
                 speculator=spec)


# model_type → (planner, architectures accepted for it)
_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama": ("dense", ("LlamaForCausalLM",)),
    "mistral": ("dense", ("MistralForCausalLM",)),
    "qwen2": ("dense", ("Qwen2ForCausalLM",)),
    "qwen3": ("dense", ("Qwen3ForCausalLM",)),
    "qwen3_vl_text": ("dense", ("Qwen3VLForConditionalGeneration",)),
    "mixtral": ("dense", ("MixtralForCausalLM",)),
    "qwen3_moe": ("dense", ("Qwen3MoeForCausalLM",)),
    "qwen3_vl_moe_text": ("dense", ("Qwen3VLMoeForConditionalGeneration",)),
    "gpt_oss": ("dense", ("GptOssForCausalLM",)),
    "minimax_m2": ("dense", ("MiniMaxM2ForCausalLM",)),
    "llama4_text": ("llama4", ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")),
    "deepseek_v2": ("deepseek", ("DeepseekV2ForCausalLM",)),
    "deepseek_v3": ("deepseek", ("DeepseekV3ForCausalLM",)),
    "kimi_k2": ("deepseek", ("DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")),
    "deepseek_v32": ("deepseek", ("DeepseekV32ForCausalLM",)),
    "glm_moe_dsa": ("deepseek", ("GlmMoeDsaForCausalLM",)),
    "nemotron_h": ("nemotron_h", ("NemotronHForCausalLM",)),
    "qwen3_next": ("qwen_hybrid", ("Qwen3NextForCausalLM",)),
    "qwen3_5_text": ("qwen_hybrid", ("Qwen3_5ForConditionalGeneration",)),
    "qwen3_5_moe_text": ("qwen_hybrid", ("Qwen3_5MoeForConditionalGeneration",)),
    "kimi_linear": ("kimi_linear", ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration")),
    "minimax_m3": ("minimax_m3", ("MiniMaxM3ForCausalLM",)),
}

# Multimodal wrappers whose text_config is a decoder this module derives.
_MULTIMODAL_ARCHS = ("Llama4ForConditionalGeneration", "KimiK25ForConditionalGeneration",
                     "KimiK3ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                     "Qwen3_5ForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                     "Qwen3VLMoeForConditionalGeneration")


def _check_architectures(cfg: _Cfg, allowed: Sequence[str]) -> None:
    archs = cfg.raw("architectures")
    if archs is None:
        return
    if not isinstance(archs, list) or not any(a in allowed for a in archs):
        cfg.refuse("architectures", f"architectures {archs!r} are not understood for this "
                                    f"model_type; expected one of {', '.join(allowed)}")


def _plan(c: _Cfg, outer: _Cfg | None) -> tuple[_Plan, str]:
    model_type = c.raw("model_type")
    if model_type is None:
        c.refuse("model_type", "required config field 'model_type' is missing; expected one of "
                               f"{', '.join(sorted(_FAMILIES))}")
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        c.refuse("model_type", f"model_type {model_type!r} is not understood; expected one of "
                               f"{', '.join(sorted(_FAMILIES))}")
    family, archs = _FAMILIES[model_type]
    if outer is not None:
        _check_architectures(outer, _MULTIMODAL_ARCHS)
        # a nested text config's own architectures, when stated, name the decoder
        inner = c.raw("architectures")
        if inner:
            _check_architectures(c, archs + ("DeepseekV3ForCausalLM", "KimiLinearForCausalLM"))
    else:
        _check_architectures(c, archs)
    if family == "dense":
        return _plan_dense_family(c, model_type), model_type
    if family == "llama4":
        return _plan_llama4(c), model_type
    if family == "deepseek":
        return _plan_deepseek(c, model_type), model_type
    if family == "nemotron_h":
        return _plan_nemotron_h(c), model_type
    if family == "qwen_hybrid":
        return _plan_qwen_hybrid(c, model_type), model_type
    if family == "kimi_linear":
        return _plan_kimi_linear(c), model_type
    if family == "minimax_m3":
        return _plan_minimax_m3(c), model_type
    raise AssertionError(family)


# -- assembling the document ------------------------------------------------------------------

def _finish_node(node: dict, scheme: _Scheme, prefix: str, where: str) -> dict:
    """Strip private keys and place weight_dtype (D34/D36) on a linear node."""
    out = {k: v for k, v in node.items() if not k.startswith("_")}
    if "_cls" in node:
        shards = [tuple(prefix + a for a in aliases) for aliases in node["_mods"]]
        dtype, not_converted = scheme.node_dtype(node["_cls"], shards, where)
        if not_converted or dtype != scheme.global_dtype:
            out["weight_dtype"] = dtype
    return out


def _compress_stack(seq: list[str]) -> dict:
    """Shortest prologue + pattern×repeat + epilogue spelling of ``seq`` (§6.4).

    Minimises |prologue| + |pattern| + |epilogue| over repeats ≥ 2; ties go to the spelling
    covering more layers with the pattern, then to the one whose longer end (prologue or
    epilogue) is shorter, then to the shorter prologue. A sequence with no repetition is all
    prologue. (§7 spells kimi-k3 this way: 2 + 22×4 + 3.)
    """
    n = len(seq)
    best = None
    for p in range(1, n // 2 + 1):
        for s in range(0, n - 2 * p + 1):
            block = seq[s:s + p]
            r = 1
            while s + (r + 1) * p <= n and seq[s + r * p:s + (r + 1) * p] == block:
                r += 1
            if r < 2:
                continue
            epi = n - s - r * p
            key = (s + p + epi, -r * p, max(s, epi), s, p)
            if best is None or key < best[0]:
                best = (key, s, p, r)
    if best is None or best[0][0] >= n:
        return {"prologue": list(seq)}
    _, s, p, r = best
    out: dict[str, Any] = {}
    if s:
        out["prologue"] = list(seq[:s])
    out["pattern"] = list(seq[s:s + p])
    out["repeat"] = r
    if s + r * p < n:
        out["epilogue"] = list(seq[s + r * p:])
    return out


def _chain_edges(n: int) -> list[list[int]]:
    # Edges are validated only (D19); like the reference graphs, each kind is one chain.
    return [[i, i + 1] for i in range(n - 1)]


#: A catalog model name: one folder name of letters, digits, ``.``, ``_``, ``+`` and ``-``,
#: starting with a letter or digit (never a path: ``--name ../../x`` would write outside
#: the models folder).
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def check_model_name(name: Any) -> str:
    """``name`` if it is a catalog model name (:data:`MODEL_NAME`), else Refusal R1."""
    if not isinstance(name, str) or not name:
        raise Refusal("R1", "the catalog name must be a non-empty string", field="name")
    if not MODEL_NAME.match(name) or ".." in name:
        raise Refusal("R1", f"{name!r} is not a catalog model name: it names the model's "
                      "folder, so it is one name of letters, digits, '.', '_', '+' and '-' "
                      "(at most 128, no '..', no '/'), e.g. llama-3.1-8b-instruct",
                      field="name")
    return name


def check_models_dir(models_dir: Any, name: str, *, argument: str = "models_dir") -> Path:
    """The folder ``<models_dir>/<name>`` a derived model is written to, checked before
    anything is derived: ``models_dir`` must be an existing folder and ``<name>`` in it a
    folder or absent. Raises :class:`~jkernel.ArgumentError` naming ``argument``."""
    from jkernel.validate import ArgumentError

    if models_dir is None or not str(models_dir).strip():
        raise ArgumentError(argument, "needs the models folder to write into")
    root = Path(models_dir)
    if not root.exists():
        raise ArgumentError(argument, f"the models folder {root} does not exist; create it "
                            "first (nothing was derived)")
    if not root.is_dir():
        raise ArgumentError(argument, f"{root} is a file, not the models folder to write "
                            f"<name>/ into")
    out = root / name
    if out.exists() and not out.is_dir():
        raise ArgumentError(argument, f"{out} exists and is not a folder")
    return out


def _derive(config: Mapping, *, name: str, sha256: str, quant_config: Mapping | None,
            source_path: str, file: str | None) -> dict:
    check_model_name(name)
    if not (isinstance(sha256, str) and len(sha256) == 64
            and all(ch in "0123456789abcdef" for ch in sha256)):
        raise Refusal("R1", "sha256 must be 64 lowercase hexadecimal digits",
                      field="derived_from.sha256")
    top = _Cfg(config, "", file)
    outer = None
    c = top
    if top.has("text_config"):
        outer = top
        c = top.sub("text_config")
    plan, model_type = _plan(c, outer)
    scheme = _resolve_scheme(c, outer, quant_config, file)
    scheme.file = file

    # Layers → distinct kinds (by finished node list) in order of first appearance.
    kinds: list[dict] = []
    by_sig: dict[str, str] = {}
    seq: list[str] = []
    for i, layer in enumerate(plan.layers):
        prefix = plan.layer_prefix.format(i=i)
        nodes = [_finish_node(n, scheme, prefix, f"layer {i} {n.get('role', n['op'])}")
                 for n in layer.nodes]
        sig = json.dumps(nodes, sort_keys=True)
        kid = by_sig.get(sig)
        if kid is None:
            kid = layer.tag
            taken = {k["id"] for k in kinds}
            j = 2
            while kid in taken:
                kid = f"{layer.tag}_{j}"
                j += 1
            by_sig[sig] = kid
            kinds.append({"id": kid, "nodes": nodes, "edges": _chain_edges(len(nodes))})
        seq.append(kid)

    head = [_ew("final_norm"),
            _finish_node(_gemm("lm_head", plan.V, plan.H, ("lm_head",)), scheme,
                         plan.head_prefix, "lm_head")]

    doc: dict[str, Any] = {"kind": "ModelGraph", "name": name}
    if outer is not None:
        doc["modality"] = "text_decoder_of_multimodal"
    doc["derived_from"] = {"format": "hf_config_json", "path": source_path, "sha256": sha256,
                           "deriver_version": DERIVER_VERSION}
    glob: dict[str, Any] = {"hidden_size": plan.H, "vocab_size": plan.V}
    tie = c.bool("tie_word_embeddings")
    if tie is None and outer is not None:
        tie = outer.bool("tie_word_embeddings")
    # spec silent; vLLM v0.31.0 reads config.tie_word_embeddings; an unstated flag is left
    # out of the graph (the key is optional) rather than guessed from a transformers default.
    if tie is not None:
        glob["tie_word_embeddings"] = tie
    glob["weight_dtype"] = scheme.global_dtype
    doc["global"] = glob
    doc["layer_kinds"] = kinds
    doc["stack"] = _compress_stack(seq)
    doc["head"] = head
    if plan.speculator:
        sp = plan.speculator
        doc["speculator"] = {"method": sp["method"], "num_spec_tokens": 1,
                             "stack": {"pattern": [seq[i] for i in sp["pattern_layers"]],
                                       "repeat": sp["repeat"]}}
    return doc


def derive_graph(config: Mapping, *, name: str, sha256: str,
                 quant_config: Mapping | None = None,
                 source_path: str = "config.json") -> dict:
    """Derive the model graph document of one HF config (documents.md §6.7).

    Args:
      config: the parsed HF ``config.json`` (a nested ``text_config`` marks a multimodal
        model, whose text decoder is derived and flagged ``text_decoder_of_multimodal``).
      name: catalog name, written as the graph's ``name``.
      sha256: 64 lowercase hex digits, the sha256 of the config file's bytes (D37).
      quant_config: the parsed ModelOpt ``hf_quant_config.json``, if the checkpoint has one.
      source_path: ``derived_from.path``, relative to the graph (default ``config.json``).

    Returns:
      A plain dict in the YAML layout of documents.md §6 (key order kind, name, modality,
      derived_from, global, layer_kinds, stack, head, speculator). GEMM ``n``/``k`` are matrix
      dims in elements; Elementwise ``bytes_per_token`` is bytes per token.

    Raises:
      Refusal: code R1, naming the config field that could not be placed.
    """
    return _derive(config, name=name, sha256=sha256, quant_config=quant_config,
                   source_path=source_path, file=None)


def _read_json(path: Path, what: str) -> tuple[bytes, Any]:
    try:
        if path.is_dir():
            raise Refusal("R2", f"the {what} is expected at {path}, which is a directory",
                          file=str(path))
        size = path.stat().st_size
        if size > _limits.MAX_DOCUMENT_BYTES:
            raise Refusal("R1", f"the {what} is {size:,} bytes: "
                          + _limits.beyond("MAX_DOCUMENT_BYTES", size), file=str(path))
        data = path.read_bytes()
    except OSError as e:
        raise Refusal("R2", f"cannot read the {what}: {e.strerror or e}",
                      file=str(path)) from None
    try:
        return data, json.loads(data)
    except RecursionError:
        raise Refusal("R1", f"the {what} nests too deeply to be a config (more than "
                      "Python's recursion limit)", file=str(path)) from None
    except ValueError as e:
        raise Refusal("R1", f"the {what} is not valid JSON: {e}", file=str(path)) from None


def derive_file(config_path: str | Path, *, name: str,
                quant_config_path: str | Path | None = None) -> dict:
    """Derive the graph of an HF ``config.json`` file; sha256 is taken over its bytes as read.

    ``quant_config_path`` names a ModelOpt ``hf_quant_config.json`` when the checkpoint has one.
    Refusals carry ``file`` = the config path.
    """
    path = Path(config_path)
    data, config = _read_json(path, "HF config")
    quant = None
    if quant_config_path is not None:
        _, quant = _read_json(Path(quant_config_path), "hf_quant_config.json")
    return _derive(config, name=name, sha256=hashlib.sha256(data).hexdigest(),
                   quant_config=quant, source_path="config.json", file=str(path))


_HF_FILE = re.compile(r"^(?P<owner>[^/]+?)--(?P<repo>.+)_config\.json$")


def _identity(config_path: Path, config: Mapping, name: str) -> dict:
    """The model.yaml identity document: name and where the config came from.

    Only facts the config file carries: the HF repository from its hf-configs file name
    (``owner--repo_config.json``) or from ``_name_or_path``. No revision or retrieval date is
    recorded because the config does not carry them.
    """
    doc: dict[str, Any] = {"name": name}
    m = _HF_FILE.match(config_path.name)
    repo = f"{m['owner']}/{m['repo']}" if m else None
    if repo is None:
        nop = config.get("_name_or_path")
        if isinstance(nop, str) and nop.count("/") == 1 and not nop.startswith((".", "/")):
            repo = nop
    if repo:
        doc["source"] = {"provider": "huggingface", "repo": repo}
    return doc


def _dump(doc: Mapping) -> str:
    return yaml.safe_dump(dict(doc), sort_keys=False, width=1 << 20, default_flow_style=False)


def write_model(config_path: str | Path, name: str, models_dir: str | Path,
                quant_config_path: str | Path | None = None) -> Path:
    """Write ``<models_dir>/<name>/{graph.yaml, config.json, model.yaml}``.

    ``config.json`` is a verbatim copy of the config bytes (its sha256 is the graph's
    ``derived_from.sha256``); a ModelOpt quant config is copied to ``hf_quant_config.json``.
    Returns the path of ``graph.yaml``.
    """
    from jkernel import atomic

    cpath = Path(config_path)
    check_model_name(name)
    out = check_models_dir(models_dir, name)          # before any work: nothing half-made
    graph = derive_file(cpath, name=name, quant_config_path=quant_config_path)
    data, config = _read_json(cpath, "HF config")
    quant = None if quant_config_path is None else \
        _read_json(Path(quant_config_path), "hf_quant_config.json")[0]
    out.mkdir(exist_ok=True)
    # Each file whole or not at all (jkernel.atomic): a failed write keeps the old one.
    atomic.write_bytes(out / "config.json", data)
    qdst = out / "hf_quant_config.json"
    if quant is not None:
        atomic.write_bytes(qdst, quant)
    elif qdst.exists():
        qdst.unlink()
    gpath = out / "graph.yaml"
    atomic.write_text(gpath, "# Derived by jkernel.derive from config.json; regenerate, do "
                      "not edit.\n" + _dump(graph))
    atomic.write_text(out / "model.yaml", _dump(_identity(cpath, config, name)))
    return gpath


def regenerate_catalog(models_dir: str | Path, hf_configs_dir: str | Path) -> list[Path]:
    """(Re)write every model of :data:`SHIPPED_MODELS` under ``models_dir``.

    Returns the written ``graph.yaml`` paths. A missing source config raises R2.
    """
    src = Path(hf_configs_dir)
    written = []
    for name, (cfg, quant) in SHIPPED_MODELS.items():
        written.append(write_model(src / cfg, name, models_dir,
                                   src / quant if quant else None))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jkernel.derive",
                                 description="Derive catalog model graphs from HF configs.")
    ap.add_argument("--hf-configs", required=True, help="directory of <owner>--<repo>_config.json")
    ap.add_argument("--out", required=True, help="catalog models directory to (re)write")
    args = ap.parse_args(argv)
    for p in regenerate_catalog(args.out, args.hf_configs):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
