"""The largest inputs jkernel takes, in one table (docs/limits.md lists them).

Every document, request file and argument is held to these bounds *before* any work
starts, so no input of a few kilobytes can make a command build, allocate or loop without
bound: a refusal names the file or argument, the field, the limit and why. Each bound is
far above anything real (the shipped catalog's largest values are given beside them) and
each has a reason in :data:`LIMITS`.

A limit is read as ``jkernel.limits.MAX_LAYERS`` (a plain int or float); :data:`LIMITS`
holds the same values with what they bound and why, for the documentation and messages.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Limit", "LIMITS", "MAX_DOCUMENT_BYTES", "MAX_YAML_DEPTH", "MAX_YAML_NODES",
           "MAX_DOCUMENT_INTEGER", "MAX_CLUSTER_NODES", "MAX_GPUS_PER_NODE",
           "MAX_CLUSTER_GPUS", "MAX_DATA_PARALLEL", "MAX_WIDTH", "MAX_GRAPH_NODES", "MAX_LAYERS", "MAX_BATCH_REQUESTS",
           "MAX_REQUESTS", "MAX_REPLAY_TOKENS", "MAX_ARRIVAL_S", "MAX_PLAN_GPUS",
           "MAX_PLAN_CANDIDATES", "MAX_WORKERS", "INT32_MAX", "beyond"]

#: The largest token count the step programs read (they hold tokens as int32).
INT32_MAX = 2 ** 31 - 1


@dataclass(frozen=True)
class Limit:
    """One bound: its constant's ``name``, ``value``, what it ``bounds`` and ``why``."""

    name: str
    value: int | float
    bounds: str
    why: str


LIMITS: tuple[Limit, ...] = (
    Limit("INT32_MAX", INT32_MAX,
          "a token count (scheduled, computed, a request's prompt and output, isl, osl) "
          "and an engine's token settings (block_size, max_num_batched_tokens, "
          "max_num_seqs, max_model_len)",
          "the step programs hold token counts as int32"),
    Limit("MAX_DOCUMENT_BYTES", 16 * 2 ** 20,
          "bytes of one YAML or JSON document file (bundle, graph, chip, coefficient set, "
          "config.json)",
          "the largest shipped file, a coefficient set, is 0.4 MB; a file is read whole"),
    Limit("MAX_YAML_DEPTH", 64, "nesting of mappings and lists in a YAML document",
          "the catalog's documents nest at most 8 deep"),
    Limit("MAX_YAML_NODES", 1_000_000,
          "values of one YAML document counted with every alias expanded",
          "aliases let a 1 KB file stand for 10⁹ values (the 'billion laughs'); the "
          "largest shipped document holds 17,431"),
    Limit("MAX_DOCUMENT_INTEGER", 2 ** 63 - 1, "any integer of a document",
          "no setting needs more than int64; larger ones only overflow later"),
    Limit("MAX_CLUSTER_NODES", 4096, "cluster.nodes and a pool's nodes",
          "the replay builds every engine of every node; the catalog's largest cluster "
          "has 36 nodes"),
    Limit("MAX_GPUS_PER_NODE", 576, "cluster.gpus_per_node and gpus_per_rack",
          "the largest NVLink domain announced (NVL576)"),
    Limit("MAX_CLUSTER_GPUS", 16_384,
          "GPUs of a cluster (nodes × gpus_per_node), and each parallel width (tp, pp, "
          "dp_local, pcp, dcp)",
          "the replay holds a scheduler for every engine of every pool; the catalog's "
          "largest cluster has 144 GPUs"),
    Limit("MAX_DATA_PARALLEL", 1024, "a pool's data-parallel width (parallel.dp)",
          "the replay prices every data-parallel rank of an engine at every step (about "
          "0.2 ms each); wide expert-parallel deployments run a few hundred"),
    Limit("MAX_WIDTH", 2 ** 24,
          "every width of a model graph (hidden, vocabulary, heads, head size, GEMM n and k, "
          "experts, windows) and of a Hugging Face config.json",
          "products of two widths stay exact in float64; the widest shipped is a 248,320 "
          "vocabulary"),
    Limit("MAX_GRAPH_NODES", 4096,
          "nodes of a model graph, over its layer kinds and head",
          "each node is a term of the compiled step program; the largest shipped graph has "
          "40"),
    Limit("MAX_LAYERS", 1024,
          "decoder layers of a model (a graph's expanded stack, a config's "
          "num_hidden_layers and MTP layers)",
          "the graph lists every layer; the deepest shipped model has 126"),
    Limit("MAX_BATCH_REQUESTS", 2 ** 20,
          "requests of one step: an NxS@C batch, a request bucket, warm_up's buckets",
          "a step's arrays are allocated per request; vLLM's max_num_seqs is far lower"),
    Limit("MAX_REQUESTS", 1_000_000,
          "rows of a request table (replay --requests, plan --requests)",
          "the replay holds every request and its token times in memory"),
    Limit("MAX_REPLAY_TOKENS", 100_000_000,
          "output tokens of a request table plus its shared-prefix tokens (prefix_length "
          "where a prefix_group is named), summed over its requests",
          "the replay keeps the time of every output token and a hash of every shared "
          "prefix block (tens of bytes each)"),
    Limit("MAX_ARRIVAL_S", 1e9,
          "an arrival time, seconds (arrival_s, arrival_time_us / 10⁶)",
          "the replay's clock counts int64 microseconds; 10⁹ s is 31.7 years"),
    Limit("MAX_PLAN_GPUS", 4096, "plan --gpus (the fleet searched)",
          "the search enumerates every split of the fleet's nodes"),
    Limit("MAX_PLAN_CANDIDATES", 100_000,
          "deployments one plan search enumerates (checked before they are built)",
          "each candidate is a row of the table; narrow the search (--mode, fewer GPUs)"),
    Limit("MAX_WORKERS", 64, "plan --workers",
          "each worker is a process holding its own JAX runtime"),
)

_BY_NAME = {lim.name: lim for lim in LIMITS}

MAX_DOCUMENT_BYTES: int = _BY_NAME["MAX_DOCUMENT_BYTES"].value
MAX_YAML_DEPTH: int = _BY_NAME["MAX_YAML_DEPTH"].value
MAX_YAML_NODES: int = _BY_NAME["MAX_YAML_NODES"].value
MAX_DOCUMENT_INTEGER: int = _BY_NAME["MAX_DOCUMENT_INTEGER"].value
MAX_CLUSTER_NODES: int = _BY_NAME["MAX_CLUSTER_NODES"].value
MAX_GPUS_PER_NODE: int = _BY_NAME["MAX_GPUS_PER_NODE"].value
MAX_CLUSTER_GPUS: int = _BY_NAME["MAX_CLUSTER_GPUS"].value
MAX_DATA_PARALLEL: int = _BY_NAME["MAX_DATA_PARALLEL"].value
MAX_WIDTH: int = _BY_NAME["MAX_WIDTH"].value
MAX_GRAPH_NODES: int = _BY_NAME["MAX_GRAPH_NODES"].value
MAX_LAYERS: int = _BY_NAME["MAX_LAYERS"].value
MAX_BATCH_REQUESTS: int = _BY_NAME["MAX_BATCH_REQUESTS"].value
MAX_REQUESTS: int = _BY_NAME["MAX_REQUESTS"].value
MAX_REPLAY_TOKENS: int = _BY_NAME["MAX_REPLAY_TOKENS"].value
MAX_ARRIVAL_S: float = _BY_NAME["MAX_ARRIVAL_S"].value
MAX_PLAN_GPUS: int = _BY_NAME["MAX_PLAN_GPUS"].value
MAX_PLAN_CANDIDATES: int = _BY_NAME["MAX_PLAN_CANDIDATES"].value
MAX_WORKERS: int = _BY_NAME["MAX_WORKERS"].value


def beyond(name: str, value) -> str:
    """The refusal text for ``value`` past limit ``name``: the value, the limit, why."""
    lim = _BY_NAME[name]
    shown = f"{value:,}" if isinstance(value, int) else f"{value:g}"
    bound = f"{lim.value:,}" if isinstance(lim.value, int) else f"{lim.value:g}"
    return (f"{shown} is past jkernel's limit of {bound} ({name}: {lim.why}; "
            "docs/limits.md)")
