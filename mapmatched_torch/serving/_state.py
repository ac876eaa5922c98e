"""What a saved server state is bound to, and the one checksum over all of it.

A :meth:`~mapmatched_torch.serving.MapMatchedServer.state_dict` (format 3) carries:

- ``checksum``: SHA-256 of every other entry (:func:`content_digest`: the sessions, the
  previous queries, the options, the fingerprints, the chunk-code names, every tensor
  with its dtype and shape, the slot bookkeeping), so no field can be edited, removed,
  renamed or swapped without the load refusing it, this entry included;
- ``graph``: :func:`graph_fingerprint` of the server's graph (its node IDs in order, its
  distance settings, its edges), since the saved chunk codes are the graph's node
  indices and the saved distances its distances;
- ``graph_codes``: the node ID of every graph code the saved turns use, which is what
  lets a state move to a graph with the same node IDs in another order
  (``load_state_dict(state, migrate=True)``).
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..core.errors import MapMatchedValueError
from ..core.protocols import implements
from ..graph.protocols import TensorGraph

__all__ = ["STATE_FORMAT", "content_digest", "graph_fingerprint", "fingerprint_differences", "same_but_order"]

#: The server state's format (3: one checksum over everything, graph fingerprint).
STATE_FORMAT = 3


def content_digest(value: Any) -> str:
    """SHA-256 of a saved state's content: dicts (keys sorted), lists and tuples (one
    kind: a file may restore either), str, int, float, bool, None and tensors (dtype,
    shape and bytes), each framed with its type and length so no two contents hash
    alike. MapMatchedValueError for anything else (a foreign object in the state)."""
    digest = hashlib.sha256()
    _feed(digest, value, 0)
    return digest.hexdigest()


def _frame(digest: Any, tag: bytes, payload: bytes) -> None:
    digest.update(tag)
    digest.update(struct.pack("<Q", len(payload)))
    digest.update(payload)


def _feed(digest: Any, value: Any, depth: int) -> None:
    if depth > 64:
        raise MapMatchedValueError("refusing the server state: it is nested deeper than any saved state")
    if value is None:
        _frame(digest, b"N", b"")
    elif isinstance(value, bool):
        _frame(digest, b"B", b"1" if value else b"0")
    elif isinstance(value, int):
        _frame(digest, b"I", str(value).encode())
    elif isinstance(value, float):
        _frame(digest, b"F", struct.pack("<d", value))
    elif isinstance(value, str):
        _frame(digest, b"S", value.encode("utf-8", "surrogatepass"))
    elif isinstance(value, (list, tuple)):
        _frame(digest, b"L", str(len(value)).encode())
        for item in value:
            _feed(digest, item, depth + 1)
    elif isinstance(value, dict):
        _frame(digest, b"D", str(len(value)).encode())
        try:
            keys = sorted(value, key=lambda key: (type(key).__name__, repr(key)))
        except Exception as error:  # (repr of a foreign key)
            raise MapMatchedValueError(f"refusing the server state: unreadable keys ({error!r})") from error
        for key in keys:
            _feed(digest, key, depth + 1)
            _feed(digest, value[key], depth + 1)
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
        _frame(digest, b"T", f"{tensor.dtype}:{tuple(tensor.shape)}".encode())
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        _frame(digest, b"t", data)
    else:
        raise MapMatchedValueError(f"refusing the server state: it holds a {type(value).__name__}, which no saved "
                                   "state holds; nothing was changed")


def _sha256_lines(names: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for name in names:
        _frame(digest, b"S", name.encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def _node_ids(graph: Any) -> Optional[Sequence[str]]:
    nodes = getattr(graph, "nodes", None)
    if callable(nodes):
        nodes = nodes()
    return tuple(str(node) for node in nodes) if nodes is not None else None


def _edges_sha256(graph: Any, nodes: Optional[Sequence[str]]) -> Optional[str]:
    """SHA-256 of the graph's arcs by chunk ID (independent of the node order): a tensor
    graph's CSR arcs renumbered by sorted chunk ID and sorted (O(E log E) tensor work),
    another graph's ``edges()`` sorted (O(E log E) Python); None for a graph that lists
    neither."""
    adjacency = getattr(graph, "adjacency", None) if implements(graph, TensorGraph) else None
    if adjacency is not None and nodes is not None:
        count = len(nodes)
        order = sorted(range(count), key=nodes.__getitem__)
        # rank[i]: node i's position among the chunk IDs sorted
        rank = torch.empty(count, dtype=torch.long)
        rank[torch.tensor(order, dtype=torch.long)] = torch.arange(count)
        indptr = adjacency.indptr.detach().to("cpu", torch.long)
        sources = torch.repeat_interleave(torch.arange(count), indptr[1:] - indptr[:-1])
        targets = adjacency.indices.detach().to("cpu", torch.long)
        key = rank[sources] * count + rank[targets]
        key, permutation = key.sort()
        digest = hashlib.sha256()
        digest.update(key.numpy().tobytes())
        digest.update(adjacency.weights.detach().to("cpu", torch.float64)[permutation].numpy().tobytes())
        return digest.hexdigest()
    edges = getattr(graph, "edges", None)
    if not callable(edges):
        return None
    arcs = sorted((str(edge.source_chunk_id), str(edge.target_chunk_id), float(edge.distance)) for edge in edges())
    digest = hashlib.sha256()
    for source, target, distance in arcs:
        _frame(digest, b"E", f"{source}\x00{target}\x00{distance!r}".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def graph_fingerprint(graph: Any) -> Dict[str, Any]:
    """What a saved state's chunk codes and distances depend on.

    Returns:
        ``codes`` ("node indices" for a tensor graph, whose node indices are the first
        chunk codes; "by arrival" otherwise), ``nodes`` (N, None when the graph does
        not list them), ``node_ids_sha256`` (the node IDs in order: a tensor graph
        only, where the order numbers the codes), ``node_set_sha256`` (the node IDs
        sorted), ``maximum_distance``, ``directed`` and ``edges_sha256`` (the arcs by
        chunk ID; None when the graph does not list them).

    Cost: O(N log N + E log E) once per call (the server keeps its graph's).
    """
    nodes = _node_ids(graph)
    tensor = implements(graph, TensorGraph)
    directed = getattr(graph, "directed", None)
    return {
        "codes": "node indices" if tensor else "by arrival",
        "nodes": len(nodes) if nodes is not None else None,
        "node_ids_sha256": _sha256_lines(nodes) if tensor and nodes is not None else None,
        "node_set_sha256": _sha256_lines(sorted(nodes)) if nodes is not None else None,
        "maximum_distance": float(graph.maximum_distance),
        "directed": bool(directed) if directed is not None else None,
        "edges_sha256": _edges_sha256(graph, nodes),
    }


def fingerprint_differences(saved: Any, mine: Dict[str, Any]) -> List[str]:
    """The fields of two fingerprints that differ, as ``"name (saved X, this Y)"``."""
    if not isinstance(saved, dict):
        return [f"fingerprint (saved {type(saved).__name__}, this a fingerprint)"]
    differing = []
    for name in sorted(set(saved) | set(mine)):
        old, new = saved.get(name, "absent"), mine.get(name, "absent")
        if old != new and not (isinstance(old, float) and isinstance(new, float) and math.isnan(old) and math.isnan(new)):
            differing.append(f"{name} (saved {_short(old)}, this {_short(new)})")
    return differing


def same_but_order(saved: Dict[str, Any], mine: Dict[str, Any]) -> bool:
    """Whether two graph fingerprints differ only in the order of the same node IDs
    (what ``migrate=True`` renumbers)."""
    return (saved.get("codes") == mine.get("codes") == "node indices" and saved.get("node_set_sha256") is not None
            and {k: v for k, v in saved.items() if k != "node_ids_sha256"}
            == {k: v for k, v in mine.items() if k != "node_ids_sha256"})


def _short(value: Any) -> str:
    text = repr(value)
    return text[:16] + "..." if isinstance(value, str) and len(value) == 64 else text
