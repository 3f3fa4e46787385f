"""treewidth_exact against brute force, known families and the heuristics."""

import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treedecomp as T


def brute_force_treewidth(G):
    """Minimum over all elimination orderings (only for tiny graphs)."""
    if len(G) == 0:
        return -1
    return min(T.decomposition_from_ordering(G, p).width for p in itertools.permutations(G))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 7), p=st.floats(0.0, 1.0), seed=st.integers(0, 10**6))
def test_exact_equals_brute_force_on_tiny_graphs(n, p, seed):
    G = nx.gnp_random_graph(n, p, seed=seed)
    td = T.treewidth_exact(G)
    T.validate(G, td)
    assert td.width == brute_force_treewidth(G)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(8, 22), p=st.floats(0.1, 0.5), seed=st.integers(0, 10**6))
def test_heuristics_never_beat_exact(n, p, seed):
    G = nx.gnp_random_graph(n, p, seed=seed)
    exact = T.treewidth_exact(G, timeout=60)
    T.validate(G, exact)
    assert T.minor_min_width(G) <= exact.width
    for td in (T.min_fill(G), T.min_degree(G), T.improve(G, max_runs=5)):
        assert td.width >= exact.width


@pytest.mark.parametrize(
    "G,width",
    [
        (nx.Graph(), -1),
        (nx.empty_graph(1), 0),
        (nx.empty_graph(4), 0),
        (nx.path_graph(30), 1),
        (nx.random_labeled_tree(40, seed=1), 1),
        (nx.cycle_graph(25), 2),
        (nx.complete_graph(7), 6),
        (nx.complete_bipartite_graph(3, 5), 3),
        (nx.petersen_graph(), 4),
        (nx.grid_2d_graph(3, 3), 3),
        (nx.grid_2d_graph(4, 4), 4),
        (nx.grid_2d_graph(5, 5), 5),
        (nx.grid_2d_graph(6, 6), 6),
        (nx.grid_2d_graph(3, 8), 3),
        (nx.hypercube_graph(4), 6),
    ],
)
def test_exact_on_known_families(G, width):
    td = T.treewidth_exact(G, timeout=60)
    T.validate(G, td)
    assert td.width == width


def test_exact_where_greedy_min_fill_is_not_optimal():
    # A small random graph on which min-fill overshoots by one.
    G = nx.gnp_random_graph(16, 0.3, seed=1)
    assert T.min_fill(G).width == 5
    td = T.treewidth_exact(G, timeout=60)
    T.validate(G, td)
    assert td.width == 4


def test_exact_on_disconnected_graph():
    G = nx.disjoint_union_all([nx.grid_2d_graph(4, 4), nx.cycle_graph(6), nx.complete_graph(3)])
    td = T.treewidth_exact(G)
    T.validate(G, td)
    assert td.width == 4


def test_exact_accepts_large_graphs_that_reductions_settle():
    G = nx.random_labeled_tree(2000, seed=4)
    assert T.treewidth_exact(G, max_vertices=10).width == 1


def test_exact_size_limit_raises_value_error():
    G = nx.gnp_random_graph(70, 0.3, seed=1)
    with pytest.raises(ValueError, match="max_vertices=60"):
        T.treewidth_exact(G)


def test_exact_timeout():
    G = nx.gnp_random_graph(45, 0.3, seed=2)
    with pytest.raises(TimeoutError):
        T.treewidth_exact(G, timeout=0.05)
