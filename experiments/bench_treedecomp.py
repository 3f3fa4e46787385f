"""Benchmark treedecomp against networkx's treewidth heuristics, side by side.

Usage (from the repository root)::

    python3 experiments/bench_treedecomp.py              # full run (about 20 minutes)
    python3 experiments/bench_treedecomp.py --quick      # under 30 s
    python3 experiments/bench_treedecomp.py --limits     # issue 17: wide min-fill, time limits, PACE gap (~3 min)
    .venv/bin/python experiments/bench_treedecomp.py --tf   # adds Keras training-step op graphs
    .venv/bin/python experiments/bench_treedecomp.py --goatd [--tf]  # min-fill against goatd (if installed)

For every graph it reports, for min-fill and min-degree, our width and
time next to networkx's ``treewidth_min_fill_in`` / ``treewidth_min_degree``
and the speed-up.  networkx runs in a separate process that is killed when
it exceeds its cap (``--nx-cap`` seconds for PACE instances,
``--nx-cap-large`` for the big synthetic and TensorFlow graphs); a capped
run shows as ``>cap``.  Times are wall-clock seconds of the decomposition
call alone (graph construction excluded) on an otherwise idle machine.
Every decomposition of ours is validated (outside the timed region).

``--limits`` measures, side by side in one run, the three figures of issue
17: min-fill CPU seconds and width on a random 3-regular graph of 10,000
vertices (width about 2,000); ``improve(timeout=T)`` wall-clock seconds
against ``T`` on the largest PACE heuristic instance and on random
3-regular graphs (stand-ins for PACE instance he150, which is not shipped);
and the PACE exact summed-width gap with ``improve`` at ``--gap-timeout``
seconds per instance (sum of widths / sum of optima - 1, and the number of
instances solved optimally).  ``--only`` picks some of the three.

``--goatd`` compares min-fill on NN op graphs (the synthetic training-step
graphs, and with ``--tf`` the Keras ones) with the compiled min-fill of
goatd (``pip install goatd``; not a dependency of this project): CPU
seconds of each call, best of a few, and both widths.  goatd's time
includes building its graph from the edge list, as ours includes reading
the networkx graph.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import networkx as nx  # noqa: E402

import treedecomp as T  # noqa: E402
from treedecomp.generators import resnet_like, towers, training_graph, unet_like  # noqa: E402

DATA = REPO.parent / "shared" / "data"


# ----------------------------------------------------------------- networkx side
def _nx_worker(edges, nodes, which, conn):
    from networkx.algorithms.approximation import treewidth_min_degree, treewidth_min_fill_in

    G = nx.Graph()
    G.add_nodes_from(nodes)
    G.add_edges_from(edges)
    f = treewidth_min_fill_in if which == "min-fill" else treewidth_min_degree
    t0 = time.perf_counter()
    width, _ = f(G)
    conn.send((width, time.perf_counter() - t0))


def run_networkx(G: nx.Graph, which: str, cap: float):
    """(width, seconds) of networkx's heuristic, or (None, None) if over ``cap`` seconds."""
    if cap <= 0:
        return None, None
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_nx_worker, args=(list(G.edges()), list(G.nodes()), which, child))
    p.start()
    child.close()
    # allow for interpreter start-up in the child on top of the cap
    result = (None, None)
    if parent.poll(cap + 5.0):
        try:
            result = parent.recv()
        except EOFError:
            pass
    p.kill()
    p.join()
    return result


# ----------------------------------------------------------------- our side
def best_seconds(run, clock=time.perf_counter, repeats=5, enough=1.0):
    """(result, best seconds) of ``run()`` over up to ``repeats`` calls,
    stopping once ``enough`` seconds are spent, timed by ``clock``."""
    best, spent, result = None, 0.0, None
    for _ in range(repeats):
        result = None  # the previous result is freed here, not inside the timed call
        t0 = clock()
        result = run()
        dt = clock() - t0
        spent += dt
        best = dt if best is None else min(best, dt)
        if spent > enough:
            break
    return result, best


def run_ours(G: nx.Graph, which: str):
    """(width, seconds, td): best time over a few repeats for fast cases."""
    f = T.min_fill if which == "min-fill" else T.min_degree
    td, best = best_seconds(lambda: f(G))
    T.validate(G, td)
    return td.width, best, td


def fmt_t(t):
    if t is None:
        return "-"
    return f"{t:.3f}" if t < 10 else f"{t:.1f}"


def speedup(ours, theirs, cap):
    if theirs is None:
        return f">{cap / ours:.0f}x" if ours > 0 and cap > 0 else "-"
    return f"{theirs / ours:.0f}x" if ours > 0 else "-"


HEADER = (
    f"{'graph':<22} {'n':>7} {'m':>8} | {'mf w':>4} {'ours s':>7} {'nx w':>4} {'nx s':>7} {'speed-up':>8} | "
    f"{'md w':>4} {'ours s':>7} {'nx w':>4} {'nx s':>7} {'speed-up':>8} | {'improve':>7}"
)


def bench_graph(name, G, cap, improve_s=1.0):
    row = [f"{name:<22} {G.number_of_nodes():>7} {G.number_of_edges():>8}"]
    for which in ("min-fill", "min-degree"):
        w, t, _ = run_ours(G, which)
        nw, nt = run_networkx(G, which, cap)
        row.append(
            f"{w:>4} {fmt_t(t):>7} {('-' if nw is None else nw):>4} "
            f"{(fmt_t(nt) if nt is not None else ('>' + str(int(cap)) if cap > 0 else '-')):>7} "
            f"{speedup(t, nt, cap):>8}"
        )
    if improve_s > 0:
        td = T.improve(G, timeout=improve_s, seed=0)
        T.validate(G, td)
        row.append(f"{td.width:>7}")
    else:
        row.append(f"{'-':>7}")
    print(" | ".join(row), flush=True)


# ----------------------------------------------------------------- goatd
def against_goatd(graphs):
    """Min-fill CPU seconds and widths, ours beside goatd's, per graph."""
    try:
        import goatd
    except ImportError:
        print("(--goatd: goatd is not installed: pip install goatd)")
        return
    print(f"{'graph':<22} {'n':>7} {'m':>8} | {'ours w':>6} {'ours s':>7} | {'goatd w':>7} {'goatd s':>7} | ours/goatd")
    ratios = []
    for name, G in graphs:
        index = {v: i for i, v in enumerate(G.nodes)}
        edges = [(index[a], index[b]) for a, b in G.edges if a != b]

        def theirs():
            return goatd.decompose(goatd.Graph(len(index), edges), order="minfill")

        td, ours_s = best_seconds(lambda: T.min_fill(G), clock=time.process_time)
        T.validate(G, td)
        their_td, their_s = best_seconds(theirs, clock=time.process_time)
        ratio = ours_s / their_s if their_s > 0 else float("inf")
        ratios.append(ratio)
        print(f"{name:<22} {G.number_of_nodes():>7} {G.number_of_edges():>8} | {td.width:>6} {ours_s:>7.3f} | "
              f"{their_td.treewidth:>7} {their_s:>7.3f} | {ratio:.2f}x", flush=True)
    if ratios:
        print(f"worst ours/goatd CPU time: {max(ratios):.2f}x (target: within 3x)")


# ----------------------------------------------------------------- TensorFlow graphs
def tf_training_op_graph(model_name: str) -> nx.Graph:
    """Undirected op graph of one traced Keras training step (weights=None)."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    keras = tf.keras
    if model_name == "ResNet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
        x_spec = tf.TensorSpec([2, 224, 224, 3], tf.float32)
        y_spec = tf.TensorSpec([2], tf.int32)
    elif model_name == "ResNet152":
        model = keras.applications.ResNet152(weights=None, input_shape=(224, 224, 3), classes=1000)
        x_spec = tf.TensorSpec([2, 224, 224, 3], tf.float32)
        y_spec = tf.TensorSpec([2], tf.int32)
    elif model_name == "Transformer":
        vocab, seq, d, heads, layers = 1000, 64, 128, 4, 4
        inp = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, d)(inp)
        for _ in range(layers):
            a = keras.layers.MultiHeadAttention(heads, d // heads)(h, h)
            h = keras.layers.LayerNormalization()(h + a)
            f = keras.layers.Dense(4 * d, activation="gelu")(h)
            f = keras.layers.Dense(d)(f)
            h = keras.layers.LayerNormalization()(h + f)
        out = keras.layers.Dense(vocab)(h)
        model = keras.Model(inp, out)
        x_spec = tf.TensorSpec([2, seq], tf.int32)
        y_spec = tf.TensorSpec([2, seq], tf.int32)
    else:
        raise ValueError(model_name)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=model_name == "Transformer")
    opt = keras.optimizers.SGD(0.01)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    graph = train_step.get_concrete_function(x_spec, y_spec).graph
    G = nx.Graph()
    for op in graph.get_operations():
        G.add_node(op.name)
        for t in op.inputs:  # data inputs only, control inputs ignored
            if t.op.name != op.name:
                G.add_edge(t.op.name, op.name)
    return G


# ----------------------------------------------------------------- PACE
def pace_exact(cap, limit=None, improve_s=0.2):
    d = DATA / "pace2017-exact"
    if not (d / "treewidth.txt").is_file():
        print(f"(PACE exact instances not found at {d}; skipped)")
        return
    optima = dict(line.split() for line in (d / "treewidth.txt").read_text().splitlines() if line.strip())
    names = sorted(optima)
    graphs = {n: T.read_gr(d / f"{n}.gr.xz") for n in names}
    if limit:
        names = sorted(names, key=lambda n: graphs[n].number_of_edges())[:limit]
    cols = ("ours min-fill", "nx min-fill", "ours min-degree", "nx min-degree", f"ours improve {improve_s}s")
    sums = dict.fromkeys(cols, 0)
    times = dict.fromkeys(cols, 0.0)
    opt_count = dict.fromkeys(cols, 0)
    missing = dict.fromkeys(cols, 0)
    opt_sum = 0
    for n in names:
        G = graphs[n]
        o = int(optima[n])
        opt_sum += o
        res = {}
        for which, ours_col, nx_col in (
            ("min-fill", cols[0], cols[1]),
            ("min-degree", cols[2], cols[3]),
        ):
            w, t, _ = run_ours(G, which)
            res[ours_col] = (w, t)
            res[nx_col] = run_networkx(G, which, cap)
        t0 = time.perf_counter()
        td = T.improve(G, timeout=improve_s, seed=0)
        res[cols[4]] = (td.width, time.perf_counter() - t0)
        T.validate(G, td)
        for c, (w, t) in res.items():
            if w is None:
                missing[c] += 1
                continue
            assert w >= o, (n, c, w, o)
            sums[c] += w
            times[c] += t
            opt_count[c] += w == o
    print(f"PACE 2017 exact instances: {len(names)} graphs, sum of optimal widths {opt_sum}")
    print(f"  {'method':<22} {'width sum':>9} {'optimal':>8} {'total s':>8}  note")
    for c in cols:
        note = f"{missing[c]} over the {cap:.0f} s cap (not summed)" if missing[c] else ""
        print(f"  {c:<22} {sums[c]:>9} {opt_count[c]:>8} {times[c]:>8.2f}  {note}", flush=True)


def pace_heuristic(cap, improve_s=1.0):
    d = DATA / "pace2017-heuristic"
    paths = sorted(d.glob("*.gr.xz")) if d.is_dir() else []
    if not paths:
        print(f"(PACE heuristic instances not found at {d}; skipped)")
        return
    print("PACE 2017 heuristic instances:")
    print(HEADER)
    for p in paths:
        bench_graph(p.name.split(".")[0], T.read_gr(p), cap, improve_s)


# ----------------------------------------------------------------- issue 17: limits
def wide_min_fill(n=10000, seed=0):
    """Min-fill CPU seconds and width on ``random_regular_graph(3, n, seed)``."""
    G = nx.random_regular_graph(3, n, seed=seed)
    c0 = time.process_time()
    t0 = time.perf_counter()
    td = T.min_fill(G)
    cpu = time.process_time() - c0
    wall = time.perf_counter() - t0
    T.validate(G, td)
    print(f"min-fill on random 3-regular n={n} seed={seed}: width {td.width}, {cpu:.2f} CPU s ({wall:.2f} s wall)")
    return td.width, cpu


def limit_graphs():
    """(name, graph) pairs on which ``improve``'s time limit is checked."""
    out = []
    he = DATA / "pace2017-heuristic" / "he123.gr.xz"
    if he.is_file():
        out.append(("he123", T.read_gr(he)))
    out.append(("3-regular 5k", nx.random_regular_graph(3, 5000, seed=0)))
    out.append(("3-regular 10k", nx.random_regular_graph(3, 10000, seed=0)))
    return out


def timeout_kept(timeouts=(0.25, 1.0, 3.0)):
    """``improve(timeout=T)``: wall seconds against ``T``, and the width reached."""
    print("improve(G, timeout=T, seed=0): wall-clock seconds of the call against T (limit 1.1 T)")
    print(f"  {'graph':<14} {'n':>6} {'T':>5} {'wall s':>7} {'CPU s':>6} {'ratio':>6} {'width':>6} {'runs':>5}")
    worst = 0.0
    for name, G in limit_graphs():
        for tmo in timeouts:
            c0 = time.process_time()
            t0 = time.perf_counter()
            res = T.improve_with_stats(G, timeout=tmo, seed=0)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - c0
            T.validate(G, res.decomposition)
            worst = max(worst, wall / tmo)
            print(
                f"  {name:<14} {G.number_of_nodes():>6} {tmo:>5.2f} {wall:>7.3f} {cpu:>6.2f} {wall / tmo:>6.2f} "
                f"{res.decomposition.width:>6} {res.runs:>5}",
                flush=True,
            )
    print(f"  worst wall / T: {worst:.2f}")
    return worst


def pace_gap(per_instance=1.0, seed=0):
    """Summed-width gap of ``improve`` on the PACE exact instances."""
    d = DATA / "pace2017-exact"
    if not (d / "treewidth.txt").is_file():
        print(f"(PACE exact instances not found at {d}; skipped)")
        return None
    optima = {a: int(b) for a, b in (line.split() for line in (d / "treewidth.txt").read_text().splitlines() if line)}
    total = opt_sum = optimal = 0
    worst = 0.0
    cpu = 0.0
    for name in sorted(optima):
        G = T.read_gr(d / f"{name}.gr.xz")
        c0 = time.process_time()
        t0 = time.perf_counter()
        td = T.improve(G, timeout=per_instance, seed=seed)
        worst = max(worst, (time.perf_counter() - t0) / per_instance)
        cpu += time.process_time() - c0
        T.validate(G, td)
        assert td.width >= optima[name], name
        total += td.width
        opt_sum += optima[name]
        optimal += td.width == optima[name]
    gap = total / opt_sum - 1
    print(
        f"PACE exact, improve(timeout={per_instance}, seed={seed}) per instance: width sum {total}, "
        f"optimum sum {opt_sum}, gap {100 * gap:.2f}%, optimal on {optimal}/{len(optima)}; "
        f"worst wall / T {worst:.2f}; {cpu:.0f} CPU s in all"
    )
    return gap, optimal


def limits(only, gap_timeout):
    """The ``--limits`` run: the three measurements of issue 17, in one process."""
    if "minfill" in only:
        wide_min_fill()
        print()
    if "timeouts" in only:
        timeout_kept()
        print()
    if "gap" in only:
        pace_gap(gap_timeout)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small graphs, short caps: finishes in < 30 s")
    ap.add_argument("--tf", action="store_true", help="also Keras ResNet50/ResNet152/Transformer training-step graphs")
    ap.add_argument("--nx-cap", type=float, default=60.0, help="seconds allowed to networkx per PACE graph")
    ap.add_argument(
        "--nx-cap-large", type=float, default=400.0, help="seconds allowed to networkx per synthetic/TF graph"
    )
    ap.add_argument("--skip-pace", action="store_true")
    ap.add_argument("--limits", action="store_true", help="issue 17: wide min-fill, time limits, PACE exact gap")
    ap.add_argument(
        "--only", default="minfill,timeouts,gap", help="with --limits: comma-separated subset of minfill,timeouts,gap"
    )
    ap.add_argument("--goatd", action="store_true", help="min-fill on NN op graphs against goatd's (if installed)")
    ap.add_argument("--gap-timeout", type=float, default=1.0, help="with --limits: improve seconds per PACE instance")
    args = ap.parse_args(argv)
    if args.limits:
        limits(set(args.only.split(",")), args.gap_timeout)
        return
    if args.goatd:
        graphs = [
            ("resnet-like 20k", training_graph(resnet_like(680, seed=0))),
            ("4 towers 20k", training_graph(towers(4, 1000, merge_every=50))),
            ("unet-like depth 8", training_graph(unet_like(8, 20))),
        ]
        if args.tf:
            graphs += [(model, tf_training_op_graph(model)) for model in ("Transformer", "ResNet50", "ResNet152")]
        against_goatd(graphs)
        return
    if args.quick:
        args.nx_cap = min(args.nx_cap, 2.0)
        args.nx_cap_large = min(args.nx_cap_large, 4.0)
    import platform

    print(
        f"treedecomp {T.__version__} vs networkx {nx.__version__}; Python {platform.python_version()}; "
        f"{mp.cpu_count()} CPUs; {'quick' if args.quick else 'full'} run"
    )
    print()
    print("mf = min-fill, md = min-degree, w = width, s = seconds; 'improve' = width after")
    print(f"treedecomp.improve with a {0.5 if args.quick else 1.0} s budget (randomised tie-breaking).")
    print()
    print("Synthetic graphs (training-step shaped graphs from treedecomp.generators):")
    print(HEADER)
    if args.quick:
        synthetic = [
            ("chain 2k", nx.path_graph(2000)),
            ("grid 30x30", nx.grid_2d_graph(30, 30)),
            ("resnet-like 2k", training_graph(resnet_like(68, seed=0))),
        ]
    else:
        synthetic = [
            ("chain 10k", nx.path_graph(10000)),
            ("grid 100x100", nx.grid_2d_graph(100, 100)),
            ("resnet-like 20k", training_graph(resnet_like(680, seed=0))),
            ("4 towers 20k", training_graph(towers(4, 1000, merge_every=50))),
            ("unet-like depth 8", training_graph(unet_like(8, 20))),
        ]
    for name, G in synthetic:
        bench_graph(name, G, args.nx_cap_large, 0.5 if args.quick else 1.0)
    if args.tf:
        try:
            import tensorflow  # noqa: F401
        except ImportError:
            print("(--tf: TensorFlow is not importable by this Python; skipped)")
        else:
            print()
            print("Keras training-step op graphs (tf.function + GradientTape + SGD, batch 2):")
            print(HEADER)
            for model in ("Transformer", "ResNet50", "ResNet152"):
                t0 = time.perf_counter()
                G = tf_training_op_graph(model)
                print(f"  (built {model}: {time.perf_counter() - t0:.0f} s)", flush=True)
                bench_graph(model, G, args.nx_cap_large, 1.0)
    if not args.skip_pace:
        print()
        pace_exact(args.nx_cap, limit=10 if args.quick else None, improve_s=0.1 if args.quick else 0.2)
        if not args.quick:
            print()
            pace_heuristic(args.nx_cap)


if __name__ == "__main__":
    main()
