"""The Colab notebooks run top to bottom on the CPU (cells tagged 'colab' are skipped)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
  nb = nbformat.read(path, as_version=4)
  nb.cells = [c for c in nb.cells if "colab" not in c.get("metadata", {}).get("tags", [])]
  client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent.parent)}})
  client.execute()  # raises CellExecutionError on the first failing cell
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]


def test_there_is_a_notebook():
  assert NOTEBOOKS
