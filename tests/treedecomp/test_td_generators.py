"""Synthetic training-step graphs: structure and widths."""

import networkx as nx

import treedecomp as T
from treedecomp.generators import resnet_like, towers, training_graph, unet_like


def test_training_graph_of_a_two_op_chain():
    F = nx.DiGraph()
    F.add_node("w", weight=True)
    F.add_edges_from([("x", "a"), ("w", "a"), ("a", "b")])
    G = training_graph(F)
    # forward: x, w, a, b; dout(a), dout(b); grad(a,x), grad(a,w), grad(b,a); apply(w)
    assert G.number_of_nodes() == 10
    assert nx.is_connected(G)
    # x, w, a, dout(a) are pairwise joined through gradient ops: a K4 minor
    assert T.treewidth_exact(G).width == 3


def test_generators_are_dags_and_widths_are_small():
    for F in (resnet_like(10, seed=1), towers(3, 20, merge_every=5), unet_like(3)):
        assert nx.is_directed_acyclic_graph(F)
        G = training_graph(F)
        assert nx.is_connected(G)
        td = T.min_fill(G)
        T.validate(G, td)
        assert td.width <= 7


def test_tower_width_grows_with_k_and_unet_width_does_not_grow_with_depth():
    # k towers: min-fill width k + 2 and the lower bound meets it
    for k in (1, 2, 4):
        G = training_graph(towers(k, 30))
        assert T.min_fill(G).width == k + 2 == T.minor_min_width(G)
    # U-Net skips nest like the rungs of a ladder, so depth adds no width
    w = {d: T.improve(training_graph(unet_like(d, 2)), timeout=0.3, seed=0).width for d in (1, 6)}
    assert w[1] == w[6] <= 5
