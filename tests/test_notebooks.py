"""The notebooks in notebooks/ run from top to bottom without errors.

They are executed in a fresh kernel (nbclient); the committed copies keep
their outputs so they read on GitHub.  Outputs produced here are thrown away.
"""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_both_notebooks_exist():
    assert {p.name for p in NOTEBOOKS} >= {"tree_decompositions.ipynb", "memory_zigzag.ipynb"}


@pytest.mark.slow  # 18-25 s each: a kernel start, Keras models traced and measured
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path):
    book = nbformat.read(path, as_version=4)
    NotebookClient(book, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    images = sum(o.output_type == "display_data" and "image/png" in o.data
                 for cell in book.cells if cell.cell_type == "code" for o in cell.outputs)
    assert images >= 2, "the notebook draws its figures"
