"""Scenario and deployment documents (spec documents.md §2), read from one bundle.

A bundle is one YAML file (or text, or a pair of mappings) holding exactly two documents,
Scenario then Deployment. Unstated engine settings read as 0, ``""`` or None (§2.5); the
resolution decides the values used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Refusal
from .. import limits as _limits
from ._strict import Reader, load_yaml_documents, read_document_text

__all__ = ["Cluster", "Scenario", "Parallel", "Speculative", "Eplb", "Dbo", "Engine", "Pool",
           "OffloadTier", "Offload", "Deployment", "parse_bundle", "load_bundle",
           "parse_version"]

CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")

#: KV block sizes vLLM accepts (vLLM v0.31.0 CacheConfig ``BlockSize`` and the choices of
#: ``--block-size``); any other size stops the engine at argument parsing.
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)

#: The vLLM releases whose engine behaviour the rules cover (major, minor), inclusive. The
#: rules follow vLLM v0.31.0; memory is validated against logs of vLLM 0.8 through 0.23.
ENGINE_VERSIONS = ((0, 8), (0, 31))


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.23.0"`` → (0, 23, 0); suffixes such as ``rc1`` or ``.post1`` are dropped."""
    parts = []
    for piece in str(version).lstrip("v").split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)  # type: ignore[return-value]


def _check_engine_version(r: Reader, version: str) -> None:
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
        ok = len(parts) >= 2 and ENGINE_VERSIONS[0] <= (major, minor) <= ENGINE_VERSIONS[1]
    except (ValueError, IndexError):
        ok = False
    if not ok:
        lo, hi = ENGINE_VERSIONS
        raise r.error("engine_version", f"vLLM {version!r} is outside the engine versions "
                      f"jkernel's rules cover: {lo[0]}.{lo[1]}.0 through {hi[0]}.{hi[1]}.x "
                      f"(the rules follow vLLM v{hi[0]}.{hi[1]}.0)")


@dataclass(frozen=True)
class Cluster:
    hardware: str
    nodes: int
    gpus_per_node: int
    fabric: str = ""
    gpus_per_rack: int = 0
    storage: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    model: str
    coefficients: tuple[str, ...]
    engine_version: str
    cluster: Cluster
    workload: tuple[tuple[str, Any], ...] | None = None   # not read by the kernel


@dataclass(frozen=True)
class Parallel:
    tp: int
    pp: int
    dp: int
    dp_local: int = 0
    enable_expert_parallel: bool = False
    pcp: int = 0
    dcp: int = 0


@dataclass(frozen=True)
class Speculative:
    method: str
    num_spec_tokens: int


@dataclass(frozen=True)
class Eplb:
    enable_eplb: bool | None = None
    num_redundant_experts: int = 0
    window_size: int = 0
    step_interval: int = 0


@dataclass(frozen=True)
class Dbo:
    enable_dbo: bool | None = None
    dbo_decode_token_threshold: int = 0
    dbo_prefill_token_threshold: int = 0


@dataclass(frozen=True)
class Engine:
    """vLLM engine settings as stated: unstated int 0, string "", tri-state bool None."""

    quantization: str = ""
    cache_dtype: str = ""
    mamba_cache_dtype: str = ""
    mamba_ssm_cache_dtype: str = ""
    mamba_cache_mode: str = ""
    block_size: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    max_model_len: int = 0
    cudagraph_mode: str = ""
    gpu_memory_utilization: float = 0.0
    speculative: Speculative | None = None
    eplb: Eplb | None = None
    all2all_backend: str = ""
    allreduce_backend: str = ""
    disable_custom_all_reduce: bool | None = None
    async_scheduling: bool | None = None
    scheduler_reserve_full_isl: bool | None = None
    disable_cascade_attn: bool | None = None
    enable_prefix_caching: bool | None = None
    dcp_comm_backend: str = ""
    dcp_q_replicate: bool | None = None
    cp_kv_cache_interleave_size: int = 0
    scheduling_policy: str = ""
    dbo: Dbo | None = None


@dataclass(frozen=True)
class Pool:
    role: str
    nodes: int
    parallel: Parallel
    engine: Engine = field(default_factory=Engine)


@dataclass(frozen=True)
class OffloadTier:
    tier: str
    bytes: int


@dataclass(frozen=True)
class Offload:
    tiers: tuple[OffloadTier, ...]
    eviction_policy: str = "lru"
    prefetch_depth: int = 0
    connector: str = ""
    spec: str = ""


@dataclass(frozen=True)
class Deployment:
    name: str
    pools: tuple[Pool, ...]
    offload: Offload | None = None
    pd_transfer_connector: str | None = None


def _freeze(v: Any) -> Any:
    if isinstance(v, Mapping):
        return tuple((k, _freeze(x)) for k, x in v.items())
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    return v


def _parse_scenario(data: Any, file: str | None) -> Scenario:
    r = Reader(data, file, "scenario")
    r.str("kind", required=True, choices=("Scenario",))
    name = r.str("name", required=True)
    model = r.str("model", required=True)
    coeffs = r.str_list("coefficients", required=True, min_len=1)
    version = r.str("engine_version", required=True)
    _check_engine_version(r, version)
    workload = None
    w = r.sub("workload")
    if w is not None:
        stated = [k for k in ("shape", "trace") if w.has(k)]
        if len(stated) != 1:
            raise w.error(None, "state exactly one of shape or trace")
        w.str("shape", None)
        w.raw("trace", None)
        w.done()
        workload = _freeze(w.data)
    c = r.sub("cluster", required=True)
    cluster = Cluster(
        hardware=c.str("hardware", required=True),
        fabric=c.str("fabric", ""),
        nodes=c.int("nodes", required=True, minimum=1, limit="MAX_CLUSTER_NODES"),
        gpus_per_node=c.int("gpus_per_node", required=True, minimum=1,
                            limit="MAX_GPUS_PER_NODE"),
        gpus_per_rack=c.int("gpus_per_rack", 0, minimum=1, limit="MAX_GPUS_PER_NODE"),
        storage=c.str_list("storage", None),
    )
    gpus = cluster.nodes * cluster.gpus_per_node
    if gpus > _limits.MAX_CLUSTER_GPUS:
        raise c.error("nodes", f"{cluster.nodes} nodes × {cluster.gpus_per_node} GPUs = "
                      f"{gpus:,} GPUs: " + _limits.beyond("MAX_CLUSTER_GPUS", gpus))
    c.done()
    r.done()
    return Scenario(name, model, coeffs, version, cluster, workload)


def _parse_engine(r: Reader | None) -> Engine:
    if r is None:
        return Engine()
    kw: dict[str, Any] = {}
    for key in ("quantization", "cache_dtype", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
                "all2all_backend"):
        kw[key] = r.str(key, "")
    kw["mamba_cache_mode"] = r.str("mamba_cache_mode", "")
    kw["cudagraph_mode"] = r.str("cudagraph_mode", "")
    kw["allreduce_backend"] = r.str("allreduce_backend", "", choices=("custom", "nccl"))
    kw["dcp_comm_backend"] = r.str("dcp_comm_backend", "")
    kw["scheduling_policy"] = r.str("scheduling_policy", "", choices=("fcfs", "priority"))
    # Unstated, these read as 0 (documents.md §2.5); a stated 0 is not "unset": vLLM
    # v0.31.0 takes only positive values for them (block_size is one of BLOCK_SIZES; the
    # scheduler declares max_num_batched_tokens and max_num_seqs ≥ 1) and a context of 0
    # tokens serves no request, so the engine would not start.
    for key in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
        kw[key] = r.int(key, 0, minimum=0, limit="INT32_MAX")
        if r.has(key) and kw[key] == 0:
            raise r.error(key, f"a stated {key} of 0 is not 'unset': vLLM does not start "
                          f"with it (it takes a positive {key}); leave the key out for the "
                          "engine's default")
    # documents.md §2.5: a cp_kv_cache_interleave_size of 0 means unstated.
    kw["cp_kv_cache_interleave_size"] = r.int("cp_kv_cache_interleave_size", 0, minimum=0,
                                              limit="INT32_MAX")
    # vLLM v0.31.0 CacheConfig: gpu_memory_utilization is a fraction in (0, 1] (pydantic
    # gt=0, le=1); a stated 0 stops the engine, so only an absent key means "the default".
    util = kw["gpu_memory_utilization"] = r.num("gpu_memory_utilization", 0.0)
    if r.has("gpu_memory_utilization") and not 0.0 < util <= 1.0:
        raise r.error("gpu_memory_utilization", f"{util} is out of range: vLLM takes the "
                      "fraction of the GPU's memory the engine may use, a number in (0, 1]")
    if kw["block_size"] and kw["block_size"] not in BLOCK_SIZES:
        raise r.error("block_size", f"vLLM does not start with block_size {kw['block_size']}; "
                      f"it accepts {', '.join(map(str, BLOCK_SIZES))}")
    for key in ("disable_custom_all_reduce", "async_scheduling", "scheduler_reserve_full_isl",
                "disable_cascade_attn", "enable_prefix_caching", "dcp_q_replicate"):
        kw[key] = r.bool(key, None)
    s = r.sub("speculative")
    if s is not None:
        kw["speculative"] = Speculative(s.str("method", required=True),
                                        s.int("num_spec_tokens", required=True, minimum=1,
                                              limit="MAX_WIDTH"))
        s.done()
    e = r.sub("eplb")
    if e is not None:
        kw["eplb"] = Eplb(e.bool("enable_eplb", None),
                          e.int("num_redundant_experts", 0, minimum=0),
                          e.int("window_size", 0, minimum=0),
                          e.int("step_interval", 0, minimum=0))
        e.done()
    d = r.sub("dbo")
    if d is not None:
        kw["dbo"] = Dbo(d.bool("enable_dbo", None),
                        d.int("dbo_decode_token_threshold", 0, minimum=0),
                        d.int("dbo_prefill_token_threshold", 0, minimum=0))
        d.done()
    r.done()
    if kw["allreduce_backend"] == "custom" and kw["disable_custom_all_reduce"] is True:
        raise r.error("disable_custom_all_reduce", "contradicts allreduce_backend: custom; "
                      "state one of them")
    return Engine(**kw)


def _parse_deployment(data: Any, file: str | None) -> Deployment:
    r = Reader(data, file, "deployment")
    r.str("kind", required=True, choices=("Deployment",))
    name = r.str("name", required=True)
    pools_raw = r.list("pools", required=True, min_len=1)
    pools = []
    for i, p in enumerate(pools_raw):
        pr = Reader(p, file, f"deployment.pools[{i}]")
        role = pr.str("role", required=True, choices=("colocated", "prefill", "decode"))
        nodes = pr.int("nodes", required=True, minimum=1, limit="MAX_CLUSTER_NODES")
        par = pr.sub("parallel", required=True)
        # tp, dp ≥ 1 are checked by resolution (R5): read them as integers here. No width
        # exceeds the largest cluster (the replay builds one scheduler per dp rank).
        wide = "MAX_CLUSTER_GPUS"
        parallel = Parallel(
            tp=par.int("tp", required=True, limit=wide),
            pp=par.int("pp", required=True, minimum=1, limit=wide),
            dp=par.int("dp", required=True, limit="MAX_DATA_PARALLEL"),
            dp_local=par.int("dp_local", 0, minimum=1, limit=wide),
            enable_expert_parallel=par.bool("enable_expert_parallel", False),
            pcp=par.int("pcp", 0, minimum=0, limit=wide),
            dcp=par.int("dcp", 0, minimum=0, limit=wide))
        par.done()
        engine = _parse_engine(pr.sub("engine"))
        pr.done()
        pools.append(Pool(role, nodes, parallel, engine))
    offload = None
    o = r.sub("offload")
    if o is not None:
        tiers = []
        for j, t in enumerate(o.list("tiers", required=True, min_len=1)):
            tr = Reader(t, file, f"deployment.offload.tiers[{j}]")
            tiers.append(OffloadTier(tr.str("tier", required=True),
                                     tr.int("bytes", required=True, minimum=1)))
            tr.done()
        offload = Offload(tuple(tiers), o.str("eviction_policy", "lru"),
                          o.int("prefetch_depth", 0, minimum=0), o.str("connector", ""),
                          o.str("spec", "", choices=("CPUOffloadingSpec",
                                                     "TieringOffloadingSpec")))
        o.done()
    pd = None
    t = r.sub("pd_transfer")
    if t is not None:
        pd = t.str("connector", required=True)
        t.done()
    r.done()
    return Deployment(name, tuple(pools), offload, pd)


def parse_bundle(source: Any, file: str | None = None) -> tuple[Scenario, Deployment]:
    """Read a bundle from YAML text or a pair of mappings (Scenario, Deployment)."""
    if isinstance(source, str):
        docs = load_yaml_documents(source, file)
    elif isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        docs = list(source)
    elif isinstance(source, Mapping):
        docs = [source]
    else:
        raise Refusal("R1", f"a bundle is YAML text, a path or two mappings, not "
                      f"{type(source).__name__}", file=file)
    docs = [d for d in docs if d is not None]
    if len(docs) != 2:
        raise Refusal("R1", "a bundle holds exactly two documents, Scenario then Deployment "
                      f"(found {len(docs)}; the older single-document combined shape is not "
                      "accepted)", file=file)
    kinds = [d.get("kind") if isinstance(d, Mapping) else None for d in docs]
    if kinds != ["Scenario", "Deployment"]:
        raise Refusal("R1", f"a bundle holds Scenario then Deployment, found kinds {kinds}",
                      file=file)
    return _parse_scenario(docs[0], file), _parse_deployment(docs[1], file)


def load_bundle(path: Path | str) -> tuple[Scenario, Deployment]:
    p = Path(path)
    hint = ("; `jkernel catalog` lists the scenarios of the catalog"
            if len(p.parts) == 1 and p.suffix not in (".yaml", ".yml") else "")
    text = read_document_text(p, what="scenario bundle", hint=hint)
    return parse_bundle(text, str(p))
