"""validate / is_valid: each of the properties is detected and named."""

import networkx as nx
import pytest

from treedecomp import InvalidDecomposition, TreeDecomposition, is_valid, min_fill, validate

PATH = nx.path_graph(4)  # 0-1-2-3


def _failing_property(G, td):
    with pytest.raises(InvalidDecomposition) as info:
        validate(G, td)
    assert not is_valid(G, td)
    return info.value.property, str(info.value)


def test_valid_decomposition_passes():
    td = TreeDecomposition([{0, 1}, {1, 2}, {2, 3}], [(0, 1), (1, 2)])
    validate(PATH, td)
    assert is_valid(PATH, td)


def test_missing_vertex():
    td = TreeDecomposition([{0, 1}, {1, 2}], [(0, 1)])
    prop, msg = _failing_property(PATH, td)
    assert prop == "vertices" and "3" in msg


def test_foreign_vertex():
    td = TreeDecomposition([{0, 1}, {1, 2}, {2, 3, 99}], [(0, 1), (1, 2)])
    prop, msg = _failing_property(PATH, td)
    assert prop == "vertices" and "99" in msg


def test_uncovered_edge():
    td = TreeDecomposition([{0, 1}, {1, 2}, {3}], [(0, 1), (1, 2)])
    prop, msg = _failing_property(PATH, td)
    assert prop == "edges" and "(2, 3)" in msg.replace("(3, 2)", "(2, 3)")


def test_disconnected_occurrences():
    # vertex 1 is in bags 0 and 2 but not in bag 1 between them
    td = TreeDecomposition([{0, 1}, {2, 3}, {1, 2}], [(0, 1), (1, 2)])
    prop, msg = _failing_property(PATH, td)
    assert prop == "connectedness" and "1" in msg


def test_not_a_tree_cycle():
    td = TreeDecomposition([{0, 1}, {1, 2}, {2, 3}], [(0, 1), (1, 2), (2, 0)])
    assert _failing_property(PATH, td)[0] == "tree"


def test_not_a_tree_forest():
    td = TreeDecomposition([{0, 1}, {1, 2}, {2, 3}], [(0, 1)])
    assert _failing_property(PATH, td)[0] == "tree"


def test_not_a_tree_self_loop():
    td = TreeDecomposition([{0, 1, 2, 3}, {0}], [(0, 0)])
    assert _failing_property(PATH, td)[0] == "tree"


def test_no_bags_for_nonempty_graph():
    assert _failing_property(PATH, TreeDecomposition([], []))[0] == "vertices"


def test_empty_graph_and_empty_decomposition():
    validate(nx.Graph(), TreeDecomposition([], []))
    validate(nx.Graph(), min_fill(nx.Graph()))


def test_directed_graph_checked_as_undirected():
    D = nx.DiGraph([(0, 1), (2, 1), (2, 3)])
    td = TreeDecomposition([{0, 1}, {1, 2}, {2, 3}], [(0, 1), (1, 2)])
    validate(D, td)
    bad = TreeDecomposition([{0, 1}, {1}, {2, 3}], [(0, 1), (1, 2)])
    assert _failing_property(D, bad)[0] == "edges"


def test_self_loops_need_no_bag_pair():
    G = nx.Graph([(0, 0), (0, 1)])
    validate(G, TreeDecomposition([{0, 1}], []))
