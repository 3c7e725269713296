"""The notebooks as files: small, no embedded plotly.js, saved executed, python3 kernel, mapped in 00.

nbval checks what the cells print; these tests check what nbval cannot: that the saved files stay
reviewable and light, and that the series map in 00_start_here lists exactly the notebooks there are.
"""
import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
MAX_NOTEBOOK_BYTES = 400 * 1024
PLOTLY_JS_MARKERS = ("cdn.plot.ly", "plotly.min.js", "Plotly.newPlot", "window.PlotlyConfig")
IGNORE_OUTPUT_TAG = "nbval-ignore-output"
PLOTLY_MIME = "application/vnd.plotly.v1+json"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_the_series_exists():
    assert len(NOTEBOOKS) >= 6, f"expected the notebook series in {NOTEBOOK_DIR}, found {NOTEBOOKS}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_small_and_has_no_embedded_plotly_js(path):
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{path.name}: {path.stat().st_size:,} B; strip big outputs"
    text = path.read_text()
    found = [m for m in PLOTLY_JS_MARKERS if m in text]
    assert not found, f"{path.name} embeds plotly.js ({found}); use jfa.workbench.widgets.setup_notebook()"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_the_python3_kernel(path):
    assert _load(path)["metadata"]["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_was_saved_executed_top_to_bottom_without_errors(path):
    cells = _code_cells(_load(path))
    counts = [c.get("execution_count") for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: execution counts {counts}; re-execute it in one run "
        "(jupyter nbconvert --to notebook --execute --inplace)")
    errors = [i for i, c in enumerate(cells) for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, f"{path.name}: code cells {errors} were saved with an error"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_figure_and_environment_outputs_are_not_compared_by_nbval(path):
    """A plotly figure's JSON changes with plotly versions; mark its cell nbval-ignore-output."""
    for cell in _code_cells(_load(path)):
        has_figure = any(PLOTLY_MIME in o.get("data", {}) for o in cell.get("outputs", []))
        tagged = IGNORE_OUTPUT_TAG in cell.get("metadata", {}).get("tags", []) or "NBVAL_IGNORE_OUTPUT" in _source(cell)
        assert tagged or not has_figure, f"{path.name}: a cell showing a figure lacks the {IGNORE_OUTPUT_TAG} tag:\n{_source(cell)}"


def _map_text() -> str:
    nb = _load(NOTEBOOK_DIR / "00_start_here.ipynb")
    return "\n".join(_source(c) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_series_map_in_00_lists_exactly_the_notebooks():
    mapped = set(re.findall(r"\]\((\d\d_[A-Za-z0-9_]+\.ipynb)\)", _map_text()))
    assert mapped == {p.name for p in NOTEBOOKS}


def test_series_map_in_00_links_every_tutorial_and_only_existing_ones():
    linked = set(re.findall(r"\]\(\.\./tutorials/(t\d\d_[A-Za-z0-9_]+\.py)\)", _map_text()))
    present = {p.name for p in (REPO / "tutorials").glob("t[0-9][0-9]_*.py")}
    assert linked == present


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_relative_links_resolve(path):
    nb = _load(path)
    text = "\n".join(_source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    for target in re.findall(r"\]\(((?:\.\./)?[A-Za-z0-9_/]+\.(?:ipynb|py|md))\)", text):
        assert (path.parent / target).exists(), f"{path.name} links to missing {target}"
