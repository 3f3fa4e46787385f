"""treedecomp against networkx: width and time of min-fill and min-degree
on training-step shaped graphs (wraps :mod:`experiments.bench_treedecomp`)."""

from __future__ import annotations

from typing import List, Tuple

import networkx as nx

from experiments import bench_treedecomp as bench
from experiments.report import Table, progress
from treedecomp.generators import resnet_like, towers, training_graph, unet_like


def graphs(scale: str) -> List[Tuple[str, nx.Graph]]:
    if scale == "tiny":
        return [("chain 300", nx.path_graph(300)), ("resnet-like 300", training_graph(resnet_like(10, seed=0)))]
    if scale == "quick":
        return [("chain 2k", nx.path_graph(2000)), ("grid 30x30", nx.grid_2d_graph(30, 30)),
                ("resnet-like 2k", training_graph(resnet_like(68, seed=0)))]
    return [("chain 10k", nx.path_graph(10000)), ("grid 100x100", nx.grid_2d_graph(100, 100)),
            ("resnet-like 20k", training_graph(resnet_like(680, seed=0))),
            ("4 towers 20k", training_graph(towers(4, 1000, merge_every=50))),
            ("unet-like depth 8", training_graph(unet_like(8, 20)))]


def run(out_dir: str, scale: str, nx_cap: float) -> dict:
    table = Table("treedecomp", "treedecomp vs networkx (width w, seconds s; networkx capped at "
                  f"{nx_cap:.0f} s)", ["graph", "nodes", "edges", "heuristic", "ours w", "ours s", "networkx w",
                                      "networkx s", "speed-up"])
    for name, graph in graphs(scale):
        for which in ("min-fill", "min-degree"):
            width, seconds, _ = bench.run_ours(graph, which)
            nx_width, nx_seconds = bench.run_networkx(graph, which, nx_cap)
            speed = round(nx_seconds / seconds, 1) if nx_seconds and seconds else None
            table.add(name, graph.number_of_nodes(), graph.number_of_edges(), which, width, round(seconds, 4),
                      nx_width, round(nx_seconds, 3) if nx_seconds is not None else f">{nx_cap:.0f}", speed)
            progress("treedecomp", f"{name} {which}: ours width {width} in {seconds:.3f} s, networkx "
                     f"{nx_width if nx_width is not None else '-'} in "
                     f"{f'{nx_seconds:.3f} s' if nx_seconds is not None else f'>{nx_cap:.0f} s'}")
    return {"files": table.write(out_dir)}
