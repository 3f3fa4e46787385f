"""The compiled min-fill set phase makes exactly the Python code's choices.

``treedecomp._compiled`` is optional (built from C at install when a compiler
is available); when it is there, ``eliminate_min_fill`` uses it, so every
other treedecomp test runs on it.  These tests run both engines on the same
graphs and compare orders, neighbourhoods at elimination, tails and widths,
with tie-breaking ranks, noisy weights, the switch to bitsets, ``abort_at``
and ``stop``.
"""

import random

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treedecomp as T
from treedecomp import _elimination as E

pytestmark = pytest.mark.skipif(E.compiled is None, reason="treedecomp._compiled was not built (no C compiler)")


def _both(adj, **kw):
    compiled = E.eliminate_min_fill(adj, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "compiled", None)
        python = E.eliminate_min_fill(adj, **kw)
    return compiled, python


def _same(a, b):
    if a is None or b is None:
        assert a is b
        return
    assert a[0] == b[0]  # order
    assert [None if h is None else sorted(h) for h in a[1]] == [None if h is None else sorted(h) for h in b[1]]
    assert a[2] == b[2] and a[3] == b[3]  # tail, width


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 70),
    p=st.floats(0.0, 0.7),
    seed=st.integers(0, 10**6),
    ranked=st.booleans(),
    noisy=st.booleans(),
    dense_degree=st.sampled_from([0, 3, 6, 10**9]),
)
def test_same_choices_on_random_graphs(n, p, seed, ranked, noisy, dense_degree):
    _, adj = E.index_graph(nx.gnp_random_graph(n, p, seed=seed))
    rng = random.Random(seed)
    rank = rng.sample(range(n), n) if ranked else None
    weight = [1 + 0.05 * rng.random() for _ in range(n)] if noisy else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "DENSE_DEGREE", dense_degree)
        _same(*_both(adj, rank=rank, weight=weight))


@pytest.mark.parametrize(
    "make",
    [
        lambda: nx.random_regular_graph(3, 600, seed=2),
        lambda: nx.grid_2d_graph(25, 25),
        lambda: nx.barabasi_albert_graph(400, 3, seed=1),  # hubs beside small neighbourhoods
        lambda: nx.star_graph(300),
    ],
    ids=["3-regular", "grid", "barabasi-albert", "star"],
)
def test_same_choices_on_structured_graphs(make):
    _, adj = E.index_graph(make())
    _same(*_both(adj))


def test_same_abort():
    _, adj = E.index_graph(nx.random_regular_graph(3, 300, seed=0))
    width = E.eliminate_min_fill(adj)[3]
    compiled, python = _both(adj, abort_at=width)
    assert compiled is None and python is None
    _same(*_both(adj, abort_at=width + 1))


@pytest.mark.parametrize("calls", [1, 2, 5, 40])
def test_same_stop(calls):
    # stop() says yes on its calls-th call: both engines stop at the same step
    _, adj = E.index_graph(nx.random_regular_graph(3, 1200, seed=1))

    def stopper():
        count = [0]

        def stop():
            count[0] += 1
            return count[0] >= calls

        return stop

    compiled = E.eliminate_min_fill(adj, stop=stopper())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "compiled", None)
        python = E.eliminate_min_fill(adj, stop=stopper())
    _same(compiled, python)


def test_errors_of_the_stop_callback_propagate():
    _, adj = E.index_graph(nx.cycle_graph(100))

    def stop():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        E.eliminate_min_fill(adj, stop=stop)


def test_min_fill_decompositions_valid_and_equal():
    G = nx.random_regular_graph(4, 500, seed=3)
    td = T.min_fill(G)
    T.validate(G, td)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "compiled", None)
        assert T.min_fill(G) == td


def test_bad_adjacency_is_refused():
    with pytest.raises(ValueError, match="not a vertex index"):
        E.compiled.min_fill([{1}, {5}], None, None, None, -1, None, 16, 256, 32, 24000)


def _python(f, *args, **kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "compiled", None)
        return f(*args, **kw)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 50),
    p=st.floats(0.0, 0.5),
    seed=st.integers(0, 10**6),
    engine=st.sampled_from(["min-fill", "min-degree", "random order"]),
    stop_after=st.sampled_from([None, 1, 3]),
)
def test_same_elimination_tree(n, p, seed, engine, stop_after):
    # disconnected graphs, tails (from the width rule or a stop), absorbed bags
    G = nx.gnp_random_graph(n, p, seed=seed)
    nodes, adj = E.index_graph(G)
    stop = None
    if stop_after is not None:
        calls = [0]

        def stop():
            calls[0] += 1
            return calls[0] > stop_after

    if engine == "random order":
        order = random.Random(seed).sample(range(n), n)
        order, higher, tail, _ = E.eliminate_in_order(adj, order)
    else:
        run = E.eliminate_min_fill if engine == "min-fill" else E.eliminate_min_degree
        order, higher, tail, _ = run(adj, stop=stop)
    labels = [f"v{v}" for v in nodes]
    compiled = E.build_decomposition(labels, order, higher, tail)
    python = _python(E.build_decomposition, labels, order, higher, tail)
    assert compiled == python and compiled.edges == python.edges


@pytest.mark.parametrize(
    "G",
    [
        nx.MultiGraph([(0, 1), (0, 1), (1, 2), (2, 0), (2, 2), (3, 4)]),
        nx.DiGraph([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]),
        nx.relabel_nodes(nx.petersen_graph(), {i: ("op", str(i)) for i in range(10)}),
        nx.Graph([(1, 1), (1, 2)]),
        nx.empty_graph(5),
        nx.Graph(),
    ],
    ids=["multigraph", "digraph", "tuple labels", "self-loop", "no edges", "empty"],
)
def test_min_fill_of_networkx_graphs_matches_python(G):
    td = T.min_fill(G)
    T.validate(G, td)
    assert td == _python(T.min_fill, G)
    assert T.min_fill(G, seed=3) == _python(T.min_fill, G, seed=3)
