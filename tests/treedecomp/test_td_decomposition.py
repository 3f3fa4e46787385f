"""TreeDecomposition: construction, width, separators, networkx conversion."""

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treedecomp as td_
from treedecomp import TreeDecomposition


def test_width_and_basic_accessors():
    td = TreeDecomposition([{1, 2, 3}, {3, 4}, {4}], [(0, 1), (1, 2)])
    assert td.width == 2
    assert len(td) == 3
    assert td.bags[1] == frozenset({3, 4})
    assert sorted(td.neighbors(1)) == [0, 2]
    assert td.vertices() == frozenset({1, 2, 3, 4})


def test_empty_decomposition_has_width_minus_one():
    td = TreeDecomposition([], [])
    assert td.width == -1
    assert td.separators() == []


def test_edge_index_out_of_range_is_rejected():
    with pytest.raises(ValueError, match="bag index"):
        TreeDecomposition([{1}], [(0, 1)])


def test_equality_ignores_edge_orientation_and_order():
    a = TreeDecomposition([{1, 2}, {2, 3}, {3, 4}], [(0, 1), (1, 2)])
    b = TreeDecomposition([{2, 1}, {3, 2}, {4, 3}], [(2, 1), (1, 0)])
    c = TreeDecomposition([{1, 2}, {2, 3}, {3, 4}], [(0, 1), (0, 2)])
    assert a == b
    assert a != c


def test_separators_of_a_path_decomposition():
    # path 1-2-3-4-5 decomposed as {1,2} - {2,3} - {3,4} - {4,5}
    td = TreeDecomposition([{1, 2}, {2, 3}, {3, 4}, {4, 5}], [(0, 1), (2, 1), (2, 3)])
    seps = td.separators()
    assert [s.edge for s in seps] == [(0, 1), (2, 1), (2, 3)]
    assert seps[0].separator == {2} and seps[0].side_i == {1} and seps[0].side_j == {3, 4, 5}
    # orientation follows the stored edge (2, 1): side_i is bag 2's side
    assert seps[1].separator == {3} and seps[1].side_i == {4, 5} and seps[1].side_j == {1, 2}
    assert seps[2].separator == {4} and seps[2].side_i == {1, 2, 3} and seps[2].side_j == {5}
    assert [(s.size_i, s.size_j) for s in seps] == [(1, 3), (2, 2), (3, 1)]


def _check_separators(G, td):
    V = set(G)
    for s in td.separators():
        i, j = s.edge
        assert s.separator == td.bags[i] & td.bags[j]
        assert s.side_i | s.side_j | s.separator == V
        assert not (s.side_i & s.side_j) and not (s.separator & (s.side_i | s.side_j))
        assert (len(s.side_i), len(s.side_j)) == (s.size_i, s.size_j)
        # the preorder slice is one whole side, away from the root
        order, lo, hi = s.preorder_slice
        assert sorted(order, key=repr) == sorted(V, key=repr)
        assert frozenset(order[lo:hi]) in (s.side_i, s.side_j)
        # side_i holds exactly the non-separator vertices of the bags on i's side
        T = td.to_networkx()
        T.remove_edge(i, j)
        side_bags = nx.node_connected_component(T, i)
        assert s.side_i == frozenset().union(*(td.bags[b] for b in side_bags)) - s.separator
        # and the separator really separates the two sides in G
        H = G.subgraph(V - s.separator)
        for comp in nx.connected_components(H):
            assert not (comp & s.side_i and comp & s.side_j)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 25), p=st.floats(0.05, 0.6), seed=st.integers(0, 10**6))
def test_separators_separate_random_graphs(n, p, seed):
    G = nx.gnp_random_graph(n, p, seed=seed)
    _check_separators(G, td_.min_fill(G))


def test_separators_of_nn_like_graph():
    from treedecomp.generators import resnet_like, training_graph

    G = training_graph(resnet_like(6, seed=3))
    _check_separators(G, td_.min_fill(G))


def test_separators_reject_cyclic_structure():
    td = TreeDecomposition([{1}, {1}, {1}], [(0, 1), (1, 2), (2, 0)])
    with pytest.raises(ValueError, match="cycle"):
        td.separators()


def test_networkx_round_trip_index_form():
    G = nx.grid_2d_graph(4, 5)
    td = td_.min_fill(G)
    T = td.to_networkx()
    assert nx.is_tree(T)
    assert all(T.nodes[i]["bag"] == b for i, b in enumerate(td.bags))
    assert TreeDecomposition.from_networkx(T) == td


def test_networkx_round_trip_bag_form_and_networkx_output():
    from networkx.algorithms.approximation import treewidth_min_fill_in

    G = nx.petersen_graph()
    width, T = treewidth_min_fill_in(G)
    td = TreeDecomposition.from_networkx(T)
    assert td.width == width
    td_.validate(G, td)
    T2 = td.to_networkx(bag_nodes=True)
    assert set(T2.nodes) == set(T.nodes)
    assert {frozenset(e) for e in T2.edges} == {frozenset(e) for e in T.edges}


def test_relabel():
    td = TreeDecomposition([{"a", "b"}, {"b", "c"}], [(0, 1)])
    assert td.relabel({"a": 1, "b": 2, "c": 3}).bags == (frozenset({1, 2}), frozenset({2, 3}))
    assert td.relabel(str.upper).bags[0] == {"A", "B"}


def test_simplified_drops_subset_bags_and_stays_valid():
    G = nx.path_graph(4)
    td = TreeDecomposition([{0, 1}, {1}, {1, 2}, {2, 3}, {3}], [(0, 1), (1, 2), (2, 3), (3, 4)])
    td_.validate(G, td)
    s = td.simplified()
    td_.validate(G, s)
    assert len(s) == 3 and s.width == 1
