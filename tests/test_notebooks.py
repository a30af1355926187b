"""The notebooks: stored executed and in sync with their builder; re-executed here in reduced mode."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _builder():
    spec = importlib.util.spec_from_file_location("build_notebooks", NOTEBOOKS / "build_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["quickstart.ipynb", "stale_delta.ipynb"])
def test_stored_notebook_is_executed_and_matches_builder(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), "stored notebook is not fully executed"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "no figure in the stored notebook"
    built = _builder().build(_builder().NOTEBOOKS[name])
    assert [c.source for c in nb.cells] == [c.source for c in built.cells], \
        "stored notebook differs from notebooks/build_notebooks.py: rebuild it"


@pytest.mark.parametrize("name", ["quickstart.ipynb", "stale_delta.ipynb"])
def test_notebook_runs_in_reduced_mode(name, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_FP8_NOTEBOOK_MODE", "reduced")
    monkeypatch.setenv("HF_FP8_ATTENTION_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    # Raises CellExecutionError (with the cell and traceback) if any cell fails.
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "mode: reduced" in text
    assert sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs) >= 1
    if name == "quickstart.ipynb":
        assert "self-test: PASS" in text and all(f"\n{a} " in text for a in ("sdpa", "fp8_stale", "fp8_delta"))
