"""The shipped PACE 2017 instances: validity, widths against the optima, speed."""

import time

import pytest

import treedecomp as T

# Measured on the development machine: plain min-fill reaches the optimum on
# 17 of the 100 exact instances (networkx's treewidth_min_fill_in also 17,
# with identical widths on every instance); a 0.2 s improvement budget per
# instance raised this to 28 before issue 17 and to 44 since (noisy
# fill-in weights).  That one is time-based, so its floor leaves room for
# slower machines.
MIN_FILL_OPTIMAL = 17
MIN_FILL_WIDTH_SUM = 4028  # networkx's treewidth_min_fill_in: 4028 as well
IMPROVED_OPTIMAL = 20
# improve with 1 s per instance (issue 17): 2.6% above the summed optimum
# and 49 optimal on the development machine; 4% is the target.
IMPROVED_1S_GAP = 0.04


def _optima(d):
    out = {}
    for line in (d / "treewidth.txt").read_text().split("\n"):
        if line.strip():
            name, w = line.split()
            out[name] = int(w)
    return out


@pytest.fixture(scope="module")
def exact_instances(pace_exact_dir):
    optima = _optima(pace_exact_dir)
    graphs = {}
    for name in sorted(optima):
        graphs[name] = T.read_gr(pace_exact_dir / f"{name}.gr.xz")
    assert len(graphs) == 100
    return graphs, optima


@pytest.mark.slow
def test_min_fill_on_all_exact_instances(exact_instances, capsys):
    graphs, optima = exact_instances
    optimal = 0
    total = 0
    for name, G in graphs.items():
        td = T.min_fill(G)
        T.validate(G, td)
        assert td.width >= optima[name], name
        optimal += td.width == optima[name]
        total += td.width
    with capsys.disabled():
        print(f"\n[treedecomp] min-fill optimal on {optimal}/100 PACE exact instances; width sum {total}")
    assert optimal >= MIN_FILL_OPTIMAL
    assert total <= MIN_FILL_WIDTH_SUM


@pytest.mark.slow
def test_min_degree_on_all_exact_instances(exact_instances):
    graphs, optima = exact_instances
    for name, G in graphs.items():
        td = T.min_degree(G)
        T.validate(G, td)
        assert td.width >= optima[name], name


def test_lower_bound_never_exceeds_optimum(exact_instances):
    graphs, optima = exact_instances
    for name, G in graphs.items():
        assert T.minor_min_width(G) <= optima[name], name


@pytest.mark.slow
def test_improve_on_all_exact_instances(exact_instances, capsys):
    graphs, optima = exact_instances
    optimal = 0
    cut_short = []
    for name, G in graphs.items():
        res = T.improve_with_stats(G, timeout=0.2, seed=0)
        td = res.decomposition
        T.validate(G, td)
        assert optima[name] <= td.width, name
        min_fill_width = T.min_fill(G).width
        if res.first_width > min_fill_width:
            # the limit is kept inside runs, so the first run can be cut
            # short: measured on 5-6 instances, the largest (1,854-3,706
            # vertices) and the densest (290,000-420,000 edges, whose graph
            # conversion alone takes about 0.2 s)
            cut_short.append(name)
        else:
            assert td.width <= min_fill_width, name
        optimal += td.width == optima[name]
    with capsys.disabled():
        print(f"\n[treedecomp] improve(0.2 s) optimal on {optimal}/100 PACE exact instances; cut short: {cut_short}")
    assert optimal >= IMPROVED_OPTIMAL
    assert len(cut_short) <= 10


@pytest.mark.slow
def test_improve_gap_with_one_second_per_instance(exact_instances, capsys):
    # time-based: run it on an otherwise idle machine
    graphs, optima = exact_instances
    total = 0
    for name, G in graphs.items():
        t0 = time.perf_counter()
        td = T.improve(G, timeout=1.0, seed=0)
        elapsed = time.perf_counter() - t0
        T.validate(G, td)
        assert elapsed <= 1.1, (name, elapsed)
        assert td.width >= optima[name], name
        total += td.width
    gap = total / sum(optima.values()) - 1
    with capsys.disabled():
        print(f"\n[treedecomp] improve(1 s): width sum {total}, {100 * gap:.2f}% above the summed optimum")
    assert gap <= IMPROVED_1S_GAP


def test_exact_solver_on_instances_settled_by_bounds(exact_instances):
    # On instances where reductions and bounds meet, the exact solver
    # answers at once even for hundreds of vertices.
    graphs, optima = exact_instances
    for name in ("ex057", "ex075", "ex081"):
        td = T.treewidth_exact(graphs[name], timeout=30)
        T.validate(graphs[name], td)
        assert td.width == optima[name]


def test_heuristic_instances_valid_and_fast(pace_heuristic_dir):
    for path in sorted(pace_heuristic_dir.glob("*.gr*")):
        G = T.read_gr(path)
        t0 = time.process_time()
        td = T.min_fill(G)
        elapsed = time.process_time() - t0
        T.validate(G, td)
        assert elapsed < 20, (path.name, elapsed)
