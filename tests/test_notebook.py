"""The exploration notebook runs headlessly on CPU against the shipped checkpoints."""
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "experiments", "notebooks", "explore_ddtree.ipynb")


def test_explore_notebook_executes():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for name in ("target", "drafter"):
        assert os.path.isdir(os.path.join(ROOT, "checkpoints", name)), f"checkpoints/{name} is not shipped"
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute()
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 2, "the tree and the confidence plot"
