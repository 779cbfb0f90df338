"""Typed, strict loaders for every input document (spec documents.md).

Each loader refuses (``Refusal`` R1/R2/R19) an unknown key, a wrong type or an impossible
value, naming the file, the key and what is allowed.
"""

from .coefficients import (CoefficientSet, Entry, Scope, coefficient_set_to_dict,
                           dump_coefficient_set, load_coefficient_set, parse_coefficient_set,
                           select)
from .graph import (DTYPE_BYTES, LayerKind, ModelGraph, Node, Speculator, Stack, dump_graph,
                    graph_to_dict, load_graph, parse_graph)
from .hardware import (Chip, Fabric, StorageClass, load_chip, load_fabric, load_storage,
                       parse_chip, parse_fabric, parse_storage)
from .scenario import (Cluster, Deployment, Engine, Offload, Parallel, Pool, Scenario,
                       load_bundle, parse_bundle)

__all__ = [
    "CoefficientSet", "Entry", "Scope", "coefficient_set_to_dict", "dump_coefficient_set",
    "load_coefficient_set", "parse_coefficient_set", "select", "DTYPE_BYTES", "LayerKind",
    "ModelGraph", "Node", "Speculator", "Stack", "dump_graph", "graph_to_dict", "load_graph",
    "parse_graph", "Chip", "Fabric", "StorageClass", "load_chip", "load_fabric",
    "load_storage", "parse_chip", "parse_fabric", "parse_storage", "Cluster", "Deployment",
    "Engine", "Offload", "Parallel", "Pool", "Scenario", "load_bundle", "parse_bundle",
]
