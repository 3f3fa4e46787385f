"""Synthetic graphs shaped like neural-network training steps.

Tests and benchmarks need graphs that look like the op graphs of real
training steps without importing a deep-learning framework.  A training
step graph is a forward graph, a backward graph that mirrors it, edges
from saved forward activations to the gradient ops that read them, and
one optimizer update per weight.  :func:`training_graph` performs that
construction on any forward DAG; :func:`resnet_like`, :func:`towers` and
:func:`unet_like` make forward DAGs with the skip structure of the three
common multi-branch families.

All graphs are undirected ``networkx.Graph`` objects with integer vertices,
as a tree decomposition needs (edge directions do not matter to it).
"""

from __future__ import annotations

import random

import networkx as nx

__all__ = ["training_graph", "resnet_like", "towers", "unet_like"]


def training_graph(forward: nx.DiGraph) -> nx.Graph:
    """Undirected op graph of a training step for the forward DAG ``forward``.

    Forward nodes with the attribute ``weight=True`` are trainable variables.
    For every forward op ``o`` the result has

    * ``o`` itself, with an edge per data input;
    * ``dout(o)``, the gradient arriving at ``o``'s output (the sum over its
      consumers' input gradients);
    * ``grad(o, x)`` for every input ``x`` of ``o``: reads ``dout(o)``, the
      other inputs of ``o`` (saved activations) and ``o``'s output, and
      feeds ``dout(x)`` -- or, for a variable ``x``, an ``apply(x)`` update
      op that also reads ``x``.
    """
    G: nx.Graph[int] = nx.Graph()
    label: dict = {}

    def node(key) -> int:
        v = label.get(key)
        if v is None:
            v = label[key] = len(label)
            G.add_node(v)
        return v

    for o in nx.topological_sort(forward):
        node(("fwd", o))
    for o in forward:
        ins = list(forward.predecessors(o))
        for x in ins:
            G.add_edge(node(("fwd", x)), node(("fwd", o)))
        if not ins:
            continue
        if forward.out_degree(o) == 0 and not forward.nodes[o].get("weight"):
            G.add_edge(node(("dout", o)), node(("fwd", o)))  # loss seeds the gradient
        for x in ins:
            g = node(("grad", o, x))
            G.add_edge(g, node(("dout", o)))
            G.add_edge(g, node(("fwd", o)))
            for y in ins:
                if y != x:
                    G.add_edge(g, node(("fwd", y)))
            if forward.nodes[x].get("weight"):
                a = node(("apply", x))
                G.add_edge(g, a)
                G.add_edge(a, node(("fwd", x)))
            elif forward.in_degree(x) > 0:
                G.add_edge(g, node(("dout", x)))
    return G


def _op(F: nx.DiGraph, inputs, weight: bool = False) -> int:
    v = F.number_of_nodes()
    F.add_node(v)
    for x in inputs:
        F.add_edge(x, v)
    if weight:
        w = F.number_of_nodes()
        F.add_node(w, weight=True)
        F.add_edge(w, v)
    return v


def resnet_like(blocks: int, ops_per_block: int = 6, seed: int | None = None) -> nx.DiGraph:
    """Forward DAG of a chain of residual blocks.

    Each block is a branch of ``ops_per_block`` ops (every third one with a
    weight, like conv - batchnorm - relu) joined to the block input by an
    add; with probability 1/4 (when ``seed`` is given) the shortcut has its
    own weighted projection op, as in downsampling blocks.
    """
    rng = random.Random(seed)
    F: nx.DiGraph[int] = nx.DiGraph()
    x = _op(F, [])
    x = _op(F, [x], weight=True)
    for _ in range(blocks):
        h = x
        for k in range(ops_per_block):
            h = _op(F, [h], weight=(k % 3 == 0))
        shortcut = x
        if seed is not None and rng.random() < 0.25:
            shortcut = _op(F, [x], weight=True)
        x = _op(F, [h, shortcut])
    _op(F, [x], weight=True)
    return F


def towers(k: int, length: int, merge_every: int = 0) -> nx.DiGraph:
    """Forward DAG of ``k`` parallel chains of ``length`` weighted ops from one input.

    The towers are concatenated at the end and, if ``merge_every`` > 0,
    also exchange their states every ``merge_every`` ops (Inception-like).
    """
    F: nx.DiGraph[int] = nx.DiGraph()
    src = _op(F, [])
    heads = [src] * k
    for step in range(1, length + 1):
        heads = [_op(F, [h], weight=True) for h in heads]
        if merge_every and step % merge_every == 0:
            m = _op(F, heads)
            heads = [m] * k
    _op(F, heads)
    return F


def unet_like(depth: int, ops_per_level: int = 3) -> nx.DiGraph:
    """Forward DAG of a U-Net: an encoder, a decoder, and a long skip per level.

    The skips nest like the rungs of a ladder (level ``i`` of the encoder to
    level ``i`` of the decoder), so the width does not grow with ``depth``;
    the long skips make the separators long-range, not large.
    """
    F: nx.DiGraph[int] = nx.DiGraph()
    x = _op(F, [])
    skips = []
    for _ in range(depth):
        for _ in range(ops_per_level):
            x = _op(F, [x], weight=True)
        skips.append(x)
        x = _op(F, [x])  # downsample
    for _ in range(ops_per_level):
        x = _op(F, [x], weight=True)
    for s in reversed(skips):
        x = _op(F, [x], weight=True)  # upsample
        x = _op(F, [x, s])  # concatenate with the skip
        for _ in range(ops_per_level):
            x = _op(F, [x], weight=True)
    _op(F, [x])
    return F
