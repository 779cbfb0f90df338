"""The static plan: what one pool's forward pass launches (spec documents.md §6.8).

Everything here is a frozen, hashable dataclass of Python numbers, fixed at construction:
layer kinds with their counts, per-kind FLOP and byte sums, fused GEMMs, attention and
recurrent nodes, planned collectives with their groups, kernel counts, graph modes, KV
geometry and expert geometry. The step function closes over a :class:`Plan`; the values it
prices with come from :mod:`jkernel.params`. Changing the plan recompiles; changing params
never does.
"""

from __future__ import annotations

from dataclasses import dataclass

from .documents.graph import DTYPE_BYTES, LATENT_KINDS, ModelGraph, Node

__all__ = ["GemmPlan", "AttentionPlan", "RecurrentPlan", "CollectivePlan", "KindPlan",
           "GroupPlan", "CollectiveKey", "Plan", "plan_layers", "collectives_needed",
           "charged_collectives", "LAUNCHES", "EAGER",
           "PIECEWISE", "FULL", "MODE_NAMES"]

#: Kernel launches per surviving node (documents.md §6.8).
LAUNCHES = {"GEMM": 1, "GroupedGEMM": 4, "Attention": 2, "Elementwise": 1,
            "RecurrentUpdate": 2, "AllReduce": 1, "AllGather": 1, "ReduceScatter": 1,
            "All2All": 2}

EAGER, PIECEWISE, FULL = 0, 1, 2
MODE_NAMES = ("EAGER", "PIECEWISE", "FULL")

_COLLECTIVE_OP = {"AllReduce": "all_reduce", "AllGather": "all_gather",
                  "ReduceScatter": "reduce_scatter", "All2All": "alltoall"}

# GEMMs vLLM runs replicated on every TP rank (expected.md refinement 1):
# vLLM v0.31.0: the MoE router gate is a ReplicatedLinear, and MLA's fused q_a/kv_a
# projection (`fused_qkv_a_proj`) is a ReplicatedLinear as well.
_REPLICATED_ROLES = ("router", "qkv_a_proj", "q_a_proj", "kv_a_proj_with_mqa", "kv_a_proj")


@dataclass(frozen=True)
class GemmPlan:
    """One GEMM after fusion (consecutive column-parallel GEMMs with the same K merge).

    ``n``, ``k``: dims of the whole (unsharded) GEMM; ``flops_per_token`` = 2·N·K;
    ``weight_bytes`` = N·K·w; ``shard_n``: column-parallel (N sharded by tp), else K sharded.
    ``vllm_rank_fraction``: the share of FLOPs and weights one TP rank holds in vLLM's real
    sharding (1 for replicated GEMMs; KV heads replicated when n_kv < tp), used by
    ``expected_s`` only; the spec's edges always divide by tp.
    """

    n: int
    k: int
    flops_per_token: float
    weight_bytes: float
    shard_n: bool
    vllm_rank_fraction: float
    roles: tuple[str, ...]


@dataclass(frozen=True)
class AttentionPlan:
    kind: str
    n_q: int
    n_kv: int
    d_h: int
    window: int = 0
    index_topk: int = 0
    compress_ratio: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    role: str = ""

    @property
    def latent(self) -> bool:
        return self.kind in LATENT_KINDS


@dataclass(frozen=True)
class RecurrentPlan:
    kind: str
    page_bytes: float        # one layer's state for one sequence (memory.md §3.1)


@dataclass(frozen=True)
class CollectivePlan:
    """A planned graph collective: op name of the registry, its group (``TP``/``Expert``),
    and whether the all-to-all dispatch is routed (bytes × top_k)."""

    op: str
    group: str
    routed: bool = False


@dataclass(frozen=True)
class KindPlan:
    id: str
    count: int
    launches: int
    gemms: tuple[GemmPlan, ...]
    dense_flops_per_token: float
    dense_weight_bytes: float
    elementwise_bytes_per_token: float
    expert_flops_per_token_per_expert: float = 0.0
    expert_weight_bytes_per_expert: float = 0.0
    shared_expert_flops_per_token: float = 0.0
    shared_expert_weight_bytes: float = 0.0
    top_k: int = 0
    experts: int = 0
    attention: AttentionPlan | None = None
    secondaries: tuple[AttentionPlan, ...] = ()
    recurrent: RecurrentPlan | None = None
    collectives: tuple[CollectivePlan, ...] = ()

    @property
    def moe(self) -> bool:
        return self.expert_flops_per_token_per_expert > 0


@dataclass(frozen=True)
class GroupPlan:
    """A communication group: width G, member stride, members per node, crossing nodes."""

    name: str
    width: int
    stride: int
    per_node: int
    crosses: bool


@dataclass(frozen=True)
class CollectiveKey:
    """Registry names of one resolved (op, group) key's triple, at the snapped width."""

    op: str
    group: str
    width: int
    floor: str
    peak: str
    transition: str


@dataclass(frozen=True)
class Plan:
    """Everything about one pool that does not depend on the batch or on a coefficient value.

    Widths are resolved (each ≥ 1). Names ending ``_name(s)`` are registry coefficient names
    the step function reads from the params pytree.
    """

    kinds: tuple[KindPlan, ...]
    head_flops_per_token: float
    head_weight_bytes: float
    hidden_size: int
    total_layers: int
    kv_layers: int
    segments: int
    total_kernels: int
    # parallel layout
    tp: int
    dp: int
    pcp: int
    dcp: int
    ep: int
    moe_group: int
    interleave: int
    groups: tuple[GroupPlan, ...]
    collective_keys: tuple[CollectiveKey, ...]
    # experts (resolution.md §4.7)
    physical_experts: int
    experts_per_rank: int
    local_expert_share: float
    expert_tensor_shards: int
    dp_slice: float
    funnel: int
    routed_a2a: bool
    # compute
    shape_aware: bool
    blackwell: bool
    # host (resolution.md §11)
    decode_mode: int
    other_mode: int
    capture_ceiling: int
    uniform_decode_width: int
    num_spec: int
    # KV geometry (memory.md §1)
    kv_bytes_per_token: float
    block_size: int
    dcp_comm_backend: str
    mla_chunk: int
    # coefficient names by role
    gemm_names: tuple[str, str, str, str]        # eps_max, m_half, n_half, k_half
    decode_pairs: tuple[tuple[str, str, str], ...]   # (kind, floor name, rate name)
    recurrent_names: tuple[tuple[str, str, str], ...]  # (kind, floor name, rate name)
    # MTP drafter (expected_s only; D7 leaves it out of the edges): the layer kinds of one
    # speculator module with their counts, when the engine speculates and the graph has one
    draft_kinds: tuple[tuple[str, int], ...] = ()

    @property
    def bpt_layer(self) -> float:
        """KV bytes per token per layer per rank: ``kvB / L_kv``."""
        return self.kv_bytes_per_token / self.kv_layers if self.kv_layers else 0.0

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def __post_init__(self):
        have = {(k.op, k.group) for k in self.collective_keys}
        missing = [c for c in charged_collectives(self) if c not in have]
        if missing:
            raise ValueError(
                "the plan charges collectives with no coefficient key: "
                + ", ".join(f"{op} over {group}" for op, group in missing)
                + f"; keys present: {sorted(have) or 'none'} (see collectives_needed)")

    def key(self, op: str, group: str) -> CollectiveKey:
        """The coefficient key of collective ``(op, group)``; every collective the step
        charges has one (checked when the plan is built), so a miss is a KeyError."""
        for k in self.collective_keys:
            if k.op == op and k.group == group:
                return k
        raise KeyError(f"no collective key for {op} over {group}")


# -- the collectives a plan needs: ONE table -------------------------------------------------

#: the attention kinds decode context parallelism shards (LATENT_KINDS, of the graph
#: documents, names the latent ones)
DCP_SHARDABLE = ("gqa", "mla", "sparse_mla")


def _context_parallel_collectives(att: AttentionPlan | None, *, tp: int, dcp: int, pcp: int,
                                  dcp_backend: str) -> list[tuple[str, str]]:
    """The (op, group) pairs the step charges for one attention under DCP/PCP (step.md
    §6.9, §6.10)."""
    out: list[tuple[str, str]] = []
    if att is None or att.n_q <= 0:
        return out
    if dcp > 1 and att.kind in DCP_SHARDABLE:
        if pcp > 1:
            if dcp > pcp:
                out.append(("all_gather", "TP"))
        else:
            out.append(("all_gather", "DCP"))
        if dcp_backend == "a2a":
            out.append(("alltoall", "DCP"))
        else:
            out.append(("all_gather", "DCP"))
            out.append(("all_reduce" if pcp > 1 else "reduce_scatter", "DCP"))
        if att.kind in LATENT_KINDS:
            out.append(("all_gather", "DCP"))                    # the MLA context gather
    if pcp > 1:
        out.append(("all_gather", "PCP"))
    return out


def _charged(kinds, *, tp: int, dcp: int, pcp: int, dcp_backend: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind in kinds:
        wanted = [(c.op, c.group) for c in kind.collectives]
        wanted += _context_parallel_collectives(kind.attention, tp=tp, dcp=dcp, pcp=pcp,
                                                dcp_backend=dcp_backend)
        out += [c for c in wanted if c not in out]
    return out


def charged_collectives(plan: "Plan") -> list[tuple[str, str]]:
    """Every (op, group) collective the step function charges for ``plan``'s layers."""
    return _charged(plan.kinds, tp=plan.tp, dcp=plan.dcp, pcp=plan.pcp,
                    dcp_backend=plan.dcp_comm_backend)


def collectives_needed(kinds, *, tp: int, moe_group: int, has_moe: bool, dcp: int, pcp: int,
                       dcp_backend: str) -> tuple[tuple[str, str], ...]:
    """The table of (op, group) collectives a plan needs coefficients for (resolution.md
    §5.3), built once: the resolution rules' keys, then any other collective the step
    charges. The coefficient lookup in :func:`jkernel.resolve.resolve` reads it, and the
    step reads the keys it produced; :class:`Plan` refuses to be built when a charged
    collective has no key, so none is ever priced as a silent zero."""
    out: list[tuple[str, str]] = []
    if tp > 1:
        out += [("all_reduce", "TP"), ("all_gather", "TP"), ("reduce_scatter", "TP")]
    if moe_group > 1 and has_moe:
        # spec silent for a model without experts; a group that runs no collective needs no
        # coefficients (the spirit of D33), so a dense model never needs the alltoall key.
        out.append(("alltoall", "Expert"))
    if dcp > 1:
        out.append(("all_gather", "DCP"))
        if dcp_backend == "a2a":
            out.append(("alltoall", "DCP"))
        elif pcp > 1:
            out.append(("all_reduce", "DCP"))
        else:
            out.append(("reduce_scatter", "DCP"))
    if pcp > 1:
        out.append(("all_gather", "PCP"))
    out += [c for c in _charged(kinds, tp=tp, dcp=dcp, pcp=pcp, dcp_backend=dcp_backend)
            if c not in out]
    return tuple(out)


# -- graph → per-kind figures ---------------------------------------------------------------

def emitted(node: Node, tp: int, moe_group: int, sp_moe: bool) -> bool:
    """Resolve a node's emit condition (documents.md §6.6; D19: on every node)."""
    e = node.emit
    if e == "tensor_parallel":
        return tp > 1
    if e == "expert_parallel":
        return moe_group > 1
    if e == "tensor_parallel_unless_sp_moe":
        return tp > 1 and not sp_moe
    return True


def _attention_plan(node: Node) -> AttentionPlan:
    return AttentionPlan(kind=node.kind, n_q=node.n_q, n_kv=node.n_kv, d_h=node.d_h,
                         window=node.get("window"), index_topk=node.get("index_topk"),
                         compress_ratio=node.get("compress_ratio"),
                         kv_lora_rank=node.get("kv_lora_rank"),
                         qk_rope_head_dim=node.get("qk_rope_head_dim"),
                         qk_nope_head_dim=node.get("qk_nope_head_dim"),
                         v_head_dim=node.get("v_head_dim"), role=node.role)


def recurrent_page_bytes(node: Node, state_bytes: float) -> float:
    """One layer's recurrent state for one sequence, bytes (memory.md §3.1, D23)."""
    s = node.state_size
    if node.recurrent_kind == "mamba2":
        temporal = node.n_heads * node.d_h * s if node.get("d_h") > 0 else node.n_heads * s * s
        conv = (node.intermediate_size + 2 * node.n_groups * s) * max(node.conv_kernel - 1, 1)
        return float((conv + temporal) * state_bytes)
    return float(node.n_heads * s * s * state_bytes)


def _vllm_fraction(role: str, n: int, tp: int, attn: AttentionPlan | None) -> float:
    """Share of a GEMM one TP rank holds in vLLM (expected.md refinement 1)."""
    if tp <= 1:
        return 1.0
    if role in _REPLICATED_ROLES:
        return 1.0
    if role == "qkv_proj" and attn is not None and attn.n_kv < tp:
        # vLLM v0.31.0 QKVParallelLinear replicates KV heads when tp > n_kv.
        d = attn.d_h
        whole = (attn.n_q + 2 * attn.n_kv) * d
        if whole == n and whole > 0:
            return (attn.n_q / tp + 2 * max(1.0, attn.n_kv / tp)) * d / whole
    return 1.0 / tp


def plan_layers(graph: ModelGraph, *, tp: int, moe_group: int, sp_moe: bool,
                served_bytes: float, state_bytes: float, routed_a2a: bool
                ) -> tuple[tuple[KindPlan, ...], dict]:
    """Group the stack by layer kind and sum FLOPs, bytes and launches per kind.

    Returns the kind plans (in order of first appearance in the stack) and head figures
    ``{"flops_per_token", "weight_bytes", "launches"}``.
    """
    H = graph.hidden_size
    order: list[str] = []
    counts: dict[str, int] = {}
    for kid in graph.stack.expanded():
        if kid not in counts:
            order.append(kid)
            counts[kid] = 0
        counts[kid] += 1

    def wbytes(node: Node) -> float:
        return DTYPE_BYTES[node.weight_dtype] if node.weight_dtype else served_bytes

    kinds = []
    for kid in order:
        lk = graph.kind(kid)
        nodes = [n for n in lk.nodes if emitted(n, tp, moe_group, sp_moe)]
        attn_nodes = [n for n in nodes if n.op == "Attention"]
        primary = next((n for n in attn_nodes if not n.role), None)
        attn = _attention_plan(primary) if primary is not None else None
        secondaries = tuple(_attention_plan(n) for n in attn_nodes if n.role)
        gemms: list[GemmPlan] = []
        prev_gemm = False
        dense_flops = dense_bytes = elem = 0.0
        e_flops = e_bytes = sh_flops = sh_bytes = 0.0
        top_k = experts = 0
        recurrent = None
        colls = []
        launches = 0
        for node in nodes:
            launches += LAUNCHES.get(node.op, 1)
            if node.op == "GEMM":
                f = 2.0 * node.n * node.k
                b = node.n * node.k * wbytes(node)
                shard_n = H > 0 and node.k == H and node.n != H
                dense_flops += f
                dense_bytes += b
                frac = _vllm_fraction(node.role, node.n, tp, attn)
                last = gemms[-1] if gemms else None
                if (prev_gemm and last is not None and shard_n and last.shard_n
                        and last.k == node.k):
                    tot_f = last.flops_per_token + f
                    gemms[-1] = GemmPlan(
                        last.n + node.n, last.k, tot_f, last.weight_bytes + b, True,
                        (last.vllm_rank_fraction * last.flops_per_token + frac * f) / tot_f,
                        last.roles + (node.role,))
                else:
                    gemms.append(GemmPlan(node.n, node.k, f, b, shard_n, frac, (node.role,)))
                prev_gemm = True
                continue
            prev_gemm = False
            if node.op == "GroupedGEMM":
                kprime = node.latent_size if node.latent_size else node.k
                w = wbytes(node)
                e_flops += 2.0 * 3 * node.n * kprime
                e_bytes += 3.0 * node.n * kprime * w
                i_s = node.shared_intermediate_size or node.n
                sh = 3.0 * i_s * node.k * node.get("shared_experts")
                sh_flops += 2.0 * sh
                sh_bytes += sh * w
                top_k, experts = node.top_k, node.experts
            elif node.op == "Elementwise":
                bpt = node.get("bytes_per_token", 0)
                elem += bpt if bpt > 0 else 2.0 * H * 2
            elif node.op == "RecurrentUpdate":
                recurrent = RecurrentPlan(node.recurrent_kind,
                                          recurrent_page_bytes(node, state_bytes))
            elif node.op in _COLLECTIVE_OP:
                group = "Expert" if node.op == "All2All" else "TP"
                colls.append(CollectivePlan(_COLLECTIVE_OP[node.op], group,
                                            node.op == "All2All" and routed_a2a))
        kinds.append(KindPlan(
            id=kid, count=counts[kid], launches=launches, gemms=tuple(gemms),
            dense_flops_per_token=dense_flops, dense_weight_bytes=dense_bytes,
            elementwise_bytes_per_token=elem, expert_flops_per_token_per_expert=e_flops,
            expert_weight_bytes_per_expert=e_bytes, shared_expert_flops_per_token=sh_flops,
            shared_expert_weight_bytes=sh_bytes, top_k=top_k, experts=experts,
            attention=attn, secondaries=secondaries, recurrent=recurrent,
            collectives=tuple(colls)))
    head_flops = head_bytes = 0.0
    head_launches = 0
    for node in graph.head:
        if not emitted(node, tp, moe_group, sp_moe):
            continue
        head_launches += LAUNCHES.get(node.op, 1)
        if node.op == "GEMM":
            head_flops += 2.0 * node.n * node.k
            head_bytes += node.n * node.k * wbytes(node)
    return tuple(kinds), {"flops_per_token": head_flops, "weight_bytes": head_bytes,
                          "launches": head_launches}
