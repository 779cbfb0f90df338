"""The static plan: what one pool's forward pass launches (spec documents.md §6.8).

Everything here is a frozen, hashable dataclass of Python numbers, fixed at construction:
layer kinds with their counts, per-kind FLOP and byte sums, fused GEMMs, attention and
recurrent nodes, the collectives each layer launches with their groups (:meth:`Plan.launches`,
the one decision of which collective the step charges), kernel counts, graph modes, KV
geometry, each attention's decode-read shape (:func:`read_shape`) and expert geometry. The
step function closes over a :class:`Plan`; the values it prices with come from
:mod:`jkernel.params`. Changing the plan recompiles; changing params never does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum, IntEnum, StrEnum

from .documents.graph import DTYPE_BYTES, AttentionKind, ModelGraph, Node

__all__ = ["AttentionKind", "GraphMode", "CollectiveOp", "Group", "Rows", "GemmPlan",
           "AttentionPlan", "RecurrentPlan", "CollectivePlan", "KindPlan", "GroupPlan",
           "CollectiveKey", "CollectiveLaunch", "ReadShape", "Plan", "plan_layers",
           "read_shape", "layer_collectives", "collectives_needed", "charged_collectives",
           "vllm_rank_fraction", "LAUNCHES"]

#: Kernel launches per surviving node (documents.md §6.8).
LAUNCHES = {"GEMM": 1, "GroupedGEMM": 4, "Attention": 2, "Elementwise": 1,
            "RecurrentUpdate": 2, "AllReduce": 1, "AllGather": 1, "ReduceScatter": 1,
            "All2All": 2}


class GraphMode(IntEnum):
    """The CUDA-graph mode a step runs in (step.md §8); an int, so traced code selects it
    with ``jnp.where``."""

    EAGER = 0
    PIECEWISE = 1
    FULL = 2


class CollectiveOp(StrEnum):
    """A collective's op as the coefficient registry names it (equal to that string)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALLTOALL = "alltoall"


class Group(StrEnum):
    """A communication group (resolution.md §5): tensor parallel, the MoE group, decode and
    prefill context parallel (equal to its name as a string)."""

    TP = "TP"
    EXPERT = "Expert"
    DCP = "DCP"
    PCP = "PCP"


_COLLECTIVE_OP = {"AllReduce": CollectiveOp.ALL_REDUCE, "AllGather": CollectiveOp.ALL_GATHER,
                  "ReduceScatter": CollectiveOp.REDUCE_SCATTER, "All2All": CollectiveOp.ALLTOALL}

# GEMMs vLLM runs replicated on every TP rank (expected.md refinement 1):
# vLLM v0.31.0: the MoE router gate is a ReplicatedLinear, and MLA's fused q_a/kv_a
# projection (`fused_qkv_a_proj`) is a ReplicatedLinear as well.
_REPLICATED_ROLES = ("router", "qkv_a_proj", "q_a_proj", "kv_a_proj_with_mqa", "kv_a_proj")


def _coerce(obj, field: str, kind) -> None:
    """Store ``obj.field`` as the enum ``kind`` (a plan built by hand may pass its string)."""
    value = getattr(obj, field)
    if not isinstance(value, kind):
        object.__setattr__(obj, field, kind(value))


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
    """One attention node of a layer kind (documents.md §6.3): the primary (``role`` "") or
    a secondary (an indexer, a compressed cache). Head counts and widths as in the graph."""

    kind: AttentionKind
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

    def __post_init__(self):
        _coerce(self, "kind", AttentionKind)


@dataclass(frozen=True)
class RecurrentPlan:
    kind: str
    page_bytes: float        # one layer's state for one sequence (memory.md §3.1)


@dataclass(frozen=True)
class CollectivePlan:
    """A collective node of the graph: its op, its group (``TP``/``Expert``), and whether
    the all-to-all dispatch is routed (bytes × top_k). :meth:`Plan.launches` lists it with
    the context-parallel collectives as what the step charges."""

    op: CollectiveOp
    group: Group
    routed: bool = False

    def __post_init__(self):
        _coerce(self, "op", CollectiveOp)
        _coerce(self, "group", Group)


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

    name: Group
    width: int
    stride: int
    per_node: int
    crosses: bool

    def __post_init__(self):
        _coerce(self, "name", Group)


@dataclass(frozen=True)
class CollectiveKey:
    """Registry names of one resolved (op, group) key's triple, at the snapped width."""

    op: CollectiveOp
    group: Group
    width: int
    floor: str
    peak: str
    transition: str

    def __post_init__(self):
        _coerce(self, "op", CollectiveOp)
        _coerce(self, "group", Group)


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
    # compute
    shape_aware: bool
    blackwell: bool
    # host (resolution.md §11)
    decode_mode: GraphMode
    other_mode: GraphMode
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

    def group(self, name: Group | str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def __post_init__(self):
        _coerce(self, "decode_mode", GraphMode)
        _coerce(self, "other_mode", GraphMode)
        have = {(k.op, k.group) for k in self.collective_keys}
        missing = [c for c in charged_collectives(self) if c not in have]
        if missing:
            raise ValueError(
                "the plan charges collectives with no coefficient key: "
                + ", ".join(f"{op} over {group}" for op, group in missing)
                + f"; keys present: {sorted(have) or 'none'} (see collectives_needed)")

    def key(self, op: CollectiveOp | str, group: Group | str) -> CollectiveKey:
        """The coefficient key of collective ``(op, group)``; every collective the step
        charges has one (checked when the plan is built), so a miss is a KeyError."""
        for k in self.collective_keys:
            if k.op == op and k.group == group:
                return k
        raise KeyError(f"no collective key for {op} over {group}")

    def launches(self, kind: KindPlan) -> tuple[CollectiveLaunch, ...]:
        """Every collective the step charges for one layer of ``kind``, in pricing order:
        the graph's, then the context-parallel ones (:func:`layer_collectives`)."""
        return layer_collectives(kind, tp=self.tp, dcp=self.dcp, pcp=self.pcp,
                                 dcp_backend=self.dcp_comm_backend)


# -- the decode read of one attention: ONE decision --------------------------------------

@dataclass(frozen=True)
class ReadShape:
    """How a decode's read of an attention's cache differs from its plain context (step.md
    §6.3): capped by a sliding window (D3), bounded by a sparse top-k with a compression
    ratio, and sharded over DCP ranks. A hashable, static record; the request lanes
    (:class:`jkernel.stages.RequestLanes`) carry one summed read per distinct shape."""

    window: int = 0
    sparse_bound: int = 0
    compress_ratio: int = 0
    dcp: int = 1
    interleave: int = 1

    @property
    def integral(self) -> bool:
        """An integer function of the context (a window cap alone)."""
        return self.window > 0 and self.sparse_bound <= 0 and self.dcp <= 1


def read_shape(plan: Plan, att: AttentionPlan) -> ReadShape | None:
    """The shape of ``att``'s decode read, or None when a decode reads its whole context."""
    window = att.window if att.kind is AttentionKind.SWA and att.window > 0 else 0
    bound = 0
    if att.kind is AttentionKind.SPARSE_MLA:
        bound = att.index_topk if att.index_topk > 0 else att.window
    dcp = plan.dcp if plan.dcp > 1 and att.kind.dcp_shardable else 1
    if not window and bound <= 0 and dcp <= 1:
        return None
    return ReadShape(window, max(bound, 0), att.compress_ratio if bound > 0 else 0, dcp,
                     plan.interleave)


# -- the collectives a step charges: ONE decision -------------------------------------------

class Rows(Enum):
    """The per-step count a planned collective's bytes scale with; :mod:`jkernel.terms`
    evaluates it for the step."""

    #: the step's hidden states: GEMM tokens (pads included) × hidden size (step.md §6.8)
    HIDDEN = "hidden"
    #: the rows DCP's query, LSE and output collectives move (step.md §6.9)
    DCP = "dcp"
    #: pcp × the prefill tokens, the PCP KV gathers' rows (step.md §6.10)
    PCP = "pcp"
    #: the prefills' cached latent context, gathered in chunks (step.md §6.9)
    CONTEXT = "context"


@dataclass(frozen=True)
class CollectiveLaunch:
    """One collective the step charges per layer: the term it adds to (``name``; launches
    with one name add up), its coefficient key ``(op, group)``, and its bytes: the step's
    ``rows`` multiplied by each of ``factors`` in order. ``all_to_all``: a group that
    crosses nodes pays the all-to-all span (else the ring's). ``dispatch_and_combine``:
    ``expected_s`` charges it as two launches (refinement 5)."""

    name: str
    op: CollectiveOp
    group: Group
    rows: Rows
    factors: tuple[float, ...]
    all_to_all: bool = False
    dispatch_and_combine: bool = False


def _graph_launch(coll: CollectivePlan, top_k: int) -> CollectiveLaunch:
    routed = coll.op is CollectiveOp.ALLTOALL and coll.routed
    name = "moe dispatch and combine" if routed else f"{coll.op} {coll.group}"
    factors = (2.0, top_k) if routed and top_k > 0 else (2.0,)
    return CollectiveLaunch(name, coll.op, coll.group, Rows.HIDDEN, factors, all_to_all=routed,
                            dispatch_and_combine=coll.op is CollectiveOp.ALLTOALL)


def _context_parallel_launches(kind: KindPlan, *, tp: int, dcp: int, pcp: int,
                               dcp_backend: str) -> list[CollectiveLaunch]:
    """DCP's query/LSE/output collectives and the MLA context gather (step.md §6.9), and
    PCP's KV gathers (§6.10: the primary's latent and rope key, then each secondary's key)."""
    att = kind.attention
    out: list[CollectiveLaunch] = []
    if att is None or att.n_q <= 0:
        return out
    ag, dg = CollectiveOp.ALL_GATHER, Group.DCP
    if dcp > 1 and att.kind.dcp_shardable:
        latent = att.kind.latent
        h, qW = att.n_q, att.d_h
        oW = att.kv_lora_rank if latent and att.kv_lora_rank > 0 else att.d_h
        if pcp > 1:
            aH = h / tp
            if dcp > pcp:
                aH = h
                out.append(CollectiveLaunch("dcp query all_gather TP", ag, Group.TP, Rows.DCP,
                                            (aH, qW, 2.0)))
        else:
            aH = h / tp * dcp                                                       # D29
            out.append(CollectiveLaunch("dcp query all_gather", ag, dg, Rows.DCP,
                                        (aH, qW, 2.0)))
        if dcp_backend == "a2a":
            out.append(CollectiveLaunch("dcp output alltoall", CollectiveOp.ALLTOALL, dg,
                                        Rows.DCP, (aH, oW + 2, 2.0), all_to_all=True))
        else:
            out.append(CollectiveLaunch("dcp lse all_gather", ag, dg, Rows.DCP,
                                        (dcp, aH, 4.0)))
            op = CollectiveOp.ALL_REDUCE if pcp > 1 else CollectiveOp.REDUCE_SCATTER
            out.append(CollectiveLaunch(f"dcp output {op}", op, dg, Rows.DCP, (aH, oW, 2.0)))
        if latent:
            out.append(CollectiveLaunch("dcp context gather", ag, dg, Rows.CONTEXT,
                                        (att.d_h, 2.0)))
    if pcp > 1:
        name, pg = "pcp kv all_gather", Group.PCP
        if 0 < att.kv_lora_rank < att.d_h:
            out.append(CollectiveLaunch(name, ag, pg, Rows.PCP, (att.kv_lora_rank, 2.0)))
            out.append(CollectiveLaunch(name, ag, pg, Rows.PCP,
                                        (att.d_h - att.kv_lora_rank, 2.0)))
        else:
            out.append(CollectiveLaunch(name, ag, pg, Rows.PCP, (att.d_h, 2.0)))
        for a in kind.secondaries:
            if a.n_kv > 0 and a.d_h > 0:
                out.append(CollectiveLaunch(name, ag, pg, Rows.PCP, (a.n_kv, a.d_h, 2.0)))
    return out


@functools.lru_cache(maxsize=256)
def layer_collectives(kind: KindPlan, *, tp: int, dcp: int, pcp: int, dcp_backend: str
                      ) -> tuple[CollectiveLaunch, ...]:
    """Every collective one layer of ``kind`` launches, as the step charges it: the graph's
    collectives (step.md §6.8), then the context-parallel ones (§6.9, §6.10). The step
    prices exactly this list (:func:`jkernel.terms.collectives`) and the coefficient table
    (:func:`collectives_needed`) is built from it."""
    return tuple([_graph_launch(c, kind.top_k) for c in kind.collectives]
                 + _context_parallel_launches(kind, tp=tp, dcp=dcp, pcp=pcp,
                                              dcp_backend=dcp_backend))


def _charged(kinds, *, tp: int, dcp: int, pcp: int, dcp_backend: str
             ) -> list[tuple[CollectiveOp, Group]]:
    out: list[tuple[CollectiveOp, Group]] = []
    for kind in kinds:
        for launch in layer_collectives(kind, tp=tp, dcp=dcp, pcp=pcp, dcp_backend=dcp_backend):
            if (launch.op, launch.group) not in out:
                out.append((launch.op, launch.group))
    return out


def charged_collectives(plan: "Plan") -> list[tuple[CollectiveOp, Group]]:
    """Every (op, group) collective the step function charges for ``plan``'s layers."""
    return _charged(plan.kinds, tp=plan.tp, dcp=plan.dcp, pcp=plan.pcp,
                    dcp_backend=plan.dcp_comm_backend)


def collectives_needed(kinds, *, tp: int, moe_group: int, has_moe: bool, dcp: int, pcp: int,
                       dcp_backend: str) -> tuple[tuple[CollectiveOp, Group], ...]:
    """The table of (op, group) collectives a plan needs coefficients for (resolution.md
    §5.3), built once: the resolution rules' keys, then any other collective the step
    charges (:func:`layer_collectives`). The coefficient lookup in
    :func:`jkernel.resolve.resolve` reads it, and the step reads the keys it produced;
    :class:`Plan` refuses to be built when a charged collective has no key, so none is ever
    priced as a silent zero."""
    op, g = CollectiveOp, Group
    out: list[tuple[CollectiveOp, Group]] = []
    if tp > 1:
        out += [(op.ALL_REDUCE, g.TP), (op.ALL_GATHER, g.TP), (op.REDUCE_SCATTER, g.TP)]
    if moe_group > 1 and has_moe:
        # spec silent for a model without experts; a group that runs no collective needs no
        # coefficients (the spirit of D33), so a dense model never needs the alltoall key.
        out.append((op.ALLTOALL, g.EXPERT))
    if dcp > 1:
        out.append((op.ALL_GATHER, g.DCP))
        if dcp_backend == "a2a":
            out.append((op.ALLTOALL, g.DCP))
        elif pcp > 1:
            out.append((op.ALL_REDUCE, g.DCP))
        else:
            out.append((op.REDUCE_SCATTER, g.DCP))
    if pcp > 1:
        out.append((op.ALL_GATHER, g.PCP))
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
    return AttentionPlan(kind=AttentionKind(node.kind), n_q=node.n_q, n_kv=node.n_kv, d_h=node.d_h,
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


def vllm_rank_fraction(role: str, n: int, tp: int, attn: AttentionPlan | None) -> float:
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
                frac = vllm_rank_fraction(node.role, node.n, tp, attn)
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
                group = Group.EXPERT if node.op == "All2All" else Group.TP
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
