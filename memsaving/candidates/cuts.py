"""Checkpoint candidates on the neutral graph model (no TensorFlow).

``articulation`` finds the single ops every input-to-output path crosses,
``separator_chain`` and ``level_cuts`` sets of ops that cut every such path,
``speed`` the expensive ops; :func:`sqrtn_sets` picks about sqrt(n) cuts.
All work on op indices of the :class:`~memsaving.model.graph.GraphModel`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import networkx as nx
import numpy as np

from memsaving.model.graph import GraphModel
from memsaving.model.parameters import parameter_ops
from memsaving.candidates.selection import bottlenecks

SPEED_OP_TYPES = frozenset(
    {
        "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
        "Conv", "Conv2D", "Conv3D", "DepthwiseConv2dNative",
        "Conv2DBackpropInput", "Conv2DBackpropInputV2", "Conv3DBackpropInputV2",
    }
)
"""Op types whose outputs ``"speed"`` keeps: the expensive ones, so that the
backward pass only recomputes cheap elementwise work.  Matched by op type,
never by name (Keras and tf.function rename freely)."""


def _has_trainable_output(model: GraphModel, i: int) -> bool:
    return any(model.tensors[t].trainable for t in model.ops[i].outputs)


def activation_digraph(model: GraphModel) -> Tuple[nx.DiGraph, List[int]]:
    """The forward ops as a DAG over op indices, without parameter ops.

    Each node has a ``"bytes"`` attribute (the bytes its outputs occupy).
    Edges follow every data input (an integer shape tensor read far
    downstream also forces recomputation to reach back).
    """
    graph: nx.DiGraph[int] = nx.DiGraph()
    params = parameter_ops(model)
    order = [i for i, op in enumerate(model.ops) if op.forward and i not in params]
    members = set(order)
    for i in order:
        graph.add_node(i, bytes=sum(model.tensors[t].nbytes for t in model.ops[i].outputs))
    for i in order:
        for t in model.ops[i].inputs:
            producer = model.tensors[t].producer
            if producer in members and producer != i:
                graph.add_edge(producer, i)
    return graph, order


Activations = Tuple[nx.DiGraph, List[int]]


def articulation(model: GraphModel, activations: Optional[Activations] = None) -> List[int]:
    """Copyable forward ops that every input-to-output path crosses, in order.

    ``activations`` is ``activation_digraph(model)`` when the caller has it.
    """
    return [i for i in bottleneck_ops(model, activations)
            if model.ops[i].copyable and _has_trainable_output(model, i)]


def bottleneck_ops(model: GraphModel, activations: Optional[Activations] = None) -> List[int]:
    """Forward ops (parameters aside) that every input-to-output path
    crosses, in order, whatever they are; :func:`articulation` keeps those
    a checkpoint can be."""
    graph, order = activations or activation_digraph(model)
    return bottlenecks(graph, order)


def speed(model: GraphModel) -> List[int]:
    """Copyable MatMul/Conv/Einsum forward ops, in order."""
    return [
        i for i, op in enumerate(model.ops)
        if op.forward and op.type in SPEED_OP_TYPES and op.copyable and _has_trainable_output(model, i)
    ]


def separator_chain(model: GraphModel, max_vertices: int = 200_000,
                    activations: Optional[Activations] = None) -> List[Tuple[List[int], int]]:
    """Sets of ops that cut every input-to-output path, ordered inputs to outputs.

    The activation DAG is made undirected and decomposed with min-fill
    (:mod:`treedecomp`).  Each separator of the decomposition (the
    intersection of two neighbouring bags) splits the graph in two; it is a
    *cut* when every source op (no activation input) lies on one side or in
    it and every sink op on the other side or in it.  Keeping a cut's outputs
    lets everything after it be recomputed, which is what multi-branch
    networks (towers, skips, U-Nets) need: they have no single separating
    tensor, but small separating sets.

    Returns
    -------
    list of tuple
        ``(cut, input_side_bytes)`` pairs, cuts as sorted lists of op indices,
        ordered by the activation bytes on their input side (consecutive cuts
        along a path of the decomposition are nested).
    """
    import treedecomp  # pylint: disable=import-outside-toplevel

    graph, order = activations or activation_digraph(model)
    if graph.number_of_nodes() < 3 or graph.number_of_nodes() > max_vertices:
        return []
    sources = {n for n in graph if graph.in_degree(n) == 0}
    sinks = {n for n in graph if graph.out_degree(n) == 0}
    td = treedecomp.min_fill(graph.to_undirected(as_view=False))
    prefix_cache = {}
    cuts: Dict[Tuple[int, ...], int] = {}  # cut -> bytes on its input side
    total_bytes = sum(graph.nodes[n]["bytes"] for n in graph)
    for sep in td.separators():
        members = sep.separator
        if not members or len(members) > 64:
            continue
        # the child's side is the slice order[lo:hi] of one preorder listing
        vertex_order, lo, hi = sep.preorder_slice
        key = id(vertex_order)
        if key not in prefix_cache:
            src = [0]
            snk = [0]
            size = [0]
            for v in vertex_order:
                src.append(src[-1] + (v in sources))
                snk.append(snk[-1] + (v in sinks))
                size.append(size[-1] + graph.nodes[v]["bytes"])
            prefix_cache[key] = (src, snk, size)
        src, snk, size = prefix_cache[key]
        src_child, snk_child = src[hi] - src[lo], snk[hi] - snk[lo]
        src_sep = sum(1 for v in members if v in sources)
        snk_sep = sum(1 for v in members if v in sinks)
        src_parent = len(sources) - src_child - src_sep
        snk_parent = len(sinks) - snk_child - snk_sep
        child_bytes = size[hi] - size[lo]
        sep_bytes = sum(graph.nodes[v]["bytes"] for v in members)
        parent_bytes = total_bytes - child_bytes - sep_bytes
        if hi - lo == 0 or len(vertex_order) - (hi - lo) - len(members) == 0:
            continue
        if src_parent == 0 and snk_child == 0 and snk_parent + snk_sep > 0:
            input_side_bytes = child_bytes  # sources below, sinks above
        elif src_child == 0 and snk_parent == 0 and snk_child + snk_sep > 0:
            input_side_bytes = parent_bytes
        else:
            continue
        cut = tuple(sorted(members))
        cuts.setdefault(cut, input_side_bytes)
    ranked = sorted(cuts.items(), key=lambda item: (item[1], len(item[0])))
    return [(list(cut), input_bytes) for cut, input_bytes in ranked]


def level_cuts(model: GraphModel, max_size: int = 64,
               activations: Optional[Activations] = None) -> List[Tuple[List[int], int]]:
    """Cuts between consecutive depth levels of the activation DAG.

    Ops are grouped by depth (longest path from a source).  After each
    level, the ops already computed that still feed a later op form the
    *frontier*: every path from the computed part to the rest crosses it, so
    keeping the frontier is enough to recompute the rest.  For k parallel
    towers the frontier after level d holds one op per tower: the cut that
    single-tensor separators (and the width-2 separators of a series-parallel
    graph's tree decomposition) cannot express.  Linear time.

    Returns
    -------
    list of tuple
        ``(cut, input_side_bytes)`` pairs in level order, cuts of at most
        ``max_size`` ops.
    """
    graph, order = activations or activation_digraph(model)
    depth, by_level = _depth_order(graph, order)
    position = {n: k for k, n in enumerate(by_level)}
    last_use = {n: max((position[s] for s in graph.successors(n)), default=-1) for n in by_level}
    frontier = set()
    cuts = []
    done_bytes = 0
    for k, n in enumerate(by_level):
        done_bytes += graph.nodes[n]["bytes"]
        if last_use[n] > k:
            frontier.add(n)
        for p in graph.predecessors(n):
            if last_use[p] == k:
                frontier.discard(p)
        level_ends = k + 1 == len(by_level) or depth[by_level[k + 1]] != depth[n]
        if level_ends and frontier and len(frontier) <= max_size and k + 1 < len(by_level):
            cuts.append((sorted(frontier), done_bytes))
    return cuts


def _depth_order(graph: nx.DiGraph, order: Sequence[int]) -> Tuple[dict, List[int]]:
    """Each op's depth (longest path from a source) and the ops sorted by
    depth, ties in ``order``."""
    depth: Dict[int, int] = {}
    for n in order:
        depth[n] = max((depth[p] + 1 for p in graph.predecessors(n)), default=0)
    rank = {n: k for k, n in enumerate(order)}
    return depth, sorted(order, key=lambda n: (depth[n], rank[n]))


def _bytes_through(graph: nx.DiGraph, order: Sequence[int]) -> dict:
    """Activation bytes computed up to and including each op, in depth order.

    The running sum of bytes in depth order gives every cut, whatever its
    kind, a comparable position between the inputs and the outputs.
    """
    running = 0
    through = {}
    for n in _depth_order(graph, order)[1]:
        running += graph.nodes[n]["bytes"]
        through[n] = running
    return through


def memory_candidates(model: GraphModel) -> List[Tuple[List[int], int]]:
    """Candidate checkpoint sets for ``"memory"`` mode and budgets.

    The single separating ops, the cuts of a tree decomposition and the
    level cuts, merged into one chain ordered by the activation bytes before
    each.  Chains get singletons; multi-branch graphs (towers, U-Nets), which
    have few or no single separators, get small cuts.
    """
    activations = activation_digraph(model)
    through = _bytes_through(*activations)
    merged: Dict[Tuple[int, ...], int] = {}  # cut -> activation bytes up to it
    found = [[i] for i in articulation(model, activations)]
    found += [cut for cut, _ in separator_chain(model, activations=activations)]
    found += [cut for cut, _ in level_cuts(model, activations=activations)]
    for cut in found:
        if all(model.ops[i].copyable for i in cut):
            # one measure for every kind of cut, so they interleave correctly
            merged.setdefault(tuple(cut), max(through[i] for i in cut))
    ranked = sorted(merged.items(), key=lambda item: (item[1], len(item[0])))
    return [(list(cut), input_bytes) for cut, input_bytes in ranked]


def sqrtn_sets(model: GraphModel, cuts: Sequence[Tuple[Sequence[int], int]], count: Optional[int] = None) -> List[int]:
    """About sqrt(n) of ``cuts``, spaced evenly by the activation bytes before each.

    ``cuts`` are ``(ops, input_side_bytes)`` pairs as :func:`memory_candidates`
    returns them.  Spacing by bytes (not by count) keeps the recomputed
    segments balanced when layers differ in size.  Returns the union of the
    chosen cuts' ops, always including the cut closest to the outputs.
    """
    if not cuts:
        return []
    total = model.activation_bytes() or 1
    if count is None:
        count = max(1, int(round(len(cuts) ** 0.5)))
    count = min(count, len(cuts))
    before = np.array([input_bytes for _, input_bytes in cuts], dtype=float)
    chosen = []
    start = 0
    for j in range(1, count + 1):
        if start >= len(cuts):
            break
        target = total * j / (count + 1)
        best = start + int(np.argmin(np.abs(before[start:] - target)))  # the first of the closest
        chosen.append(best)
        start = best + 1
    # The last cut, and the last cut across several branches, too: after it
    # only the ops that join the branches are differentiated in place, and
    # each branch's tail is recomputed on its own; without it every branch's
    # tail would be alive at once, which for k towers caps the saving near 2x.
    chosen.append(len(cuts) - 1)
    multi = [k for k in range(len(cuts)) if len(cuts[k][0]) > 1]
    if multi and multi[-1] > max(chosen[:-1], default=-1):
        chosen.append(multi[-1])
    return sorted({i for k in chosen for i in cuts[k][0]})
