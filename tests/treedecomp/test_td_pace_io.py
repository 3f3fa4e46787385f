"""PACE .gr/.td reading and writing, malformed input, and the command line."""

import io
import lzma
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import treedecomp as T
from treedecomp import PaceFormatError

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _same_graph(G, H):
    return set(G) == set(H) and {frozenset(e) for e in G.edges} == {frozenset(e) for e in H.edges}


def test_read_gr_plain_with_comments_and_isolated_vertices(tmp_path):
    p = _write(tmp_path / "g.gr", "c a comment\np tw 5 3\n1 2\nc inner comment\n2 3\n\n3 1\n")
    G = T.read_gr(p)
    assert sorted(G) == [1, 2, 3, 4, 5]
    assert {frozenset(e) for e in G.edges} == {frozenset({1, 2}), frozenset({2, 3}), frozenset({1, 3})}


def test_read_gr_xz_by_content_not_name(tmp_path):
    data = b"p tw 3 2\n1 2\n2 3\n"
    (tmp_path / "a.gr.xz").write_bytes(lzma.compress(data))
    (tmp_path / "b.gr").write_bytes(lzma.compress(data))  # xz without the suffix
    for name in ("a.gr.xz", "b.gr"):
        G = T.read_gr(tmp_path / name)
        assert G.number_of_nodes() == 3 and G.number_of_edges() == 2


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 30), p=st.floats(0, 0.5), seed=st.integers(0, 10**6), xz=st.booleans())
def test_gr_and_td_round_trip(tmp_path_factory, n, p, seed, xz):
    d = tmp_path_factory.mktemp("rt")
    G = nx.relabel_nodes(nx.gnp_random_graph(n, p, seed=seed), lambda v: v + 1)
    suffix = ".xz" if xz else ""
    num = T.write_gr(G, d / f"g.gr{suffix}")
    assert num == {v: v for v in G}
    H = T.read_gr(d / f"g.gr{suffix}")
    assert _same_graph(G, H)
    td = T.min_fill(H)
    T.write_td(td, d / f"g.td{suffix}", n_vertices=n)
    back = T.read_td(d / f"g.td{suffix}")
    assert back == td
    T.validate(H, back)


def test_write_gr_numbers_arbitrary_vertices_and_td_uses_the_numbering(tmp_path):
    G = nx.DiGraph([("x", "y"), ("y", "x"), ("y", "z"), ("z", "z")])  # directed, self-loop
    num = T.write_gr(G, tmp_path / "g.gr", comment="from a digraph")
    assert sorted(num.values()) == [1, 2, 3]
    text = (tmp_path / "g.gr").read_text().splitlines()
    assert text[0] == "c from a digraph" and text[1] == "p tw 3 2"
    H = T.read_gr(tmp_path / "g.gr")
    td = T.min_fill(G)
    buf = io.StringIO()
    T.write_td(td, buf, numbering=num)
    back = T.parse_td(buf.getvalue().splitlines())
    T.validate(H, back)
    assert back.width == td.width == 1


def test_empty_graph_files(tmp_path):
    G = T.read_gr(_write(tmp_path / "e.gr", "p tw 0 0\n"))
    assert len(G) == 0
    td = T.min_fill(G)
    T.write_td(td, tmp_path / "e.td", n_vertices=0)
    assert (tmp_path / "e.td").read_text() == "s td 0 0 0\n"
    back = T.read_td(tmp_path / "e.td")
    assert back.width == -1 and len(back) == 0


@pytest.mark.parametrize(
    "text,line,fragment",
    [
        ("p tw 3 2\n1 2\n2 x\n", 3, "expected integers"),
        ("p tw 3 2\n1 2\n2 3 4\n", 3, "expected an edge"),
        ("p tw 3 1\n1 4\n", 2, "outside 1..3"),
        ("c hi\n1 2\np tw 3 1\n", 2, "before the 'p tw N M' line"),
        ("p td 3 1\n1 2\n", 1, "expected 'p tw N M'"),
        ("p tw 3\n", 1, "expected 'p tw N M'"),
        ("p tw 3 1\np tw 3 1\n1 2\n", 2, "second 'p' line"),
        ("p tw 3 2\n1 2\n", 1, "declares 2 edges but 1"),
        ("p tw 2 1\n0 1\n", 2, "outside 1..2"),
    ],
)
def test_malformed_gr_names_file_and_line(tmp_path, text, line, fragment):
    p = _write(tmp_path / "bad.gr", text)
    with pytest.raises(PaceFormatError) as info:
        T.read_gr(p)
    assert info.value.line == line
    assert f"bad.gr:{line}:" in str(info.value)
    assert fragment in str(info.value)


def test_gr_without_p_line(tmp_path):
    with pytest.raises(PaceFormatError, match="no 'p tw N M' line"):
        T.read_gr(_write(tmp_path / "c.gr", "c only comments\n"))


@pytest.mark.parametrize(
    "text,line,fragment",
    [
        ("s td 2 2 3\nb 1 1 2\nb 2 2 3\n1 3\n", 4, "outside 1..2"),
        ("s td 2 2 3\nb 1 1 2\nb 1 2 3\n1 2\n", 3, "given twice"),
        ("s td 2 2 3\nb 1 1 9\nb 2 2 3\n1 2\n", 2, "vertex 9 outside"),
        ("s td 2 3 3\nb 1 1 2\nb 2 2 3\n1 2\n", 1, "largest bag has 3"),
        ("s td 2 2 3\nb 1 1 2\n", 1, "not given: [2]"),
        ("b 1 1 2\n", 1, "before the 's td B W N' line"),
        ("s td 1 1 1\nb 1 1\n1 x\n", 3, "expected integers"),
    ],
)
def test_malformed_td_names_line(tmp_path, text, line, fragment):
    with pytest.raises(PaceFormatError) as info:
        T.read_td(_write(tmp_path / "bad.td", text))
    assert info.value.line == line and fragment in str(info.value)


def test_td_with_empty_bag_and_comments(tmp_path):
    td = T.read_td(_write(tmp_path / "x.td", "c hello\ns td 2 2 2\nb 1 1 2\nb 2\n1 2\n"))
    assert td.bags == (frozenset({1, 2}), frozenset())


# ---------------------------------------------------------------- command line
def _cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "treedecomp", *map(str, args)],
        cwd=REPO,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_writes_valid_td(tmp_path):
    G = nx.relabel_nodes(nx.grid_2d_graph(6, 6), {v: i for i, v in enumerate(nx.grid_2d_graph(6, 6), 1)})
    T.write_gr(G, tmp_path / "g.gr.xz")
    for extra in ([], ["--heuristic", "min-degree"], ["--timeout", "0.3", "--seed", "4"]):
        r = _cli(tmp_path / "g.gr.xz", "--validate", *extra)
        assert r.returncode == 0, r.stderr
        td = T.parse_td(r.stdout.splitlines())
        T.validate(G, td)
        assert r.stdout.startswith(f"s td {len(td)} {td.width + 1} 36\n")


def test_cli_reads_stdin_and_reports_with_verbose():
    r = _cli("-", "-v", stdin="p tw 4 4\n1 2\n2 3\n3 4\n4 1\n")
    assert r.returncode == 0
    assert T.parse_td(r.stdout.splitlines()).width == 2
    assert "width 2" in r.stderr


def test_cli_malformed_input_exit_2_names_line(tmp_path):
    p = _write(tmp_path / "bad.gr", "p tw 3 2\n1 2\n2 three\n")
    r = _cli(p)
    assert r.returncode == 2
    assert r.stdout == ""
    assert f"{p}:3:" in r.stderr


def test_cli_missing_and_corrupt_files_exit_2(tmp_path):
    r = _cli(tmp_path / "nope.gr")
    assert r.returncode == 2 and "nope.gr" in r.stderr
    bad = tmp_path / "trunc.gr.xz"
    bad.write_bytes(lzma.compress(b"p tw 3 1\n1 2\n")[:-8])
    r = _cli(bad)
    assert r.returncode == 2 and "trunc.gr.xz" in r.stderr


def test_cli_bad_option_exit_2():
    assert _cli("--heuristic", "max-fill", "x.gr").returncode == 2
    assert _cli("--timeout", "-1", "x.gr").returncode == 2
