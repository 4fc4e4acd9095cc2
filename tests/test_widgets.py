"""Widgets in the HTML report: a static stand-in drawn from the saved widget state (the
controls as the run left them, an Output widget's figures and tables), with the line saying
they are interactive in JupyterLab; no widget manager or CDN on the page."""

import nbformat

from k3lab import report, widgets

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJ"
       "RU5ErkJggg==")


def _notebook(with_state: bool = True):
    nb = nbformat.v4.new_notebook()
    view = {"model_id": "box", "version_major": 2, "version_minor": 0}
    cell = nbformat.v4.new_code_cell("display(w)")
    cell.outputs = [nbformat.v4.new_output(
        "display_data", data={widgets.VIEW_MIME: view, "text/plain": "VBox(children=...)"})]
    nb.cells = [cell]
    state = {
        "box": {"model_name": "VBoxModel", "state": {"children": [
            "IPY_MODEL_row", "IPY_MODEL_out"]}},
        "row": {"model_name": "HBoxModel", "state": {"children": [
            "IPY_MODEL_slider", "IPY_MODEL_pick", "IPY_MODEL_tick", "IPY_MODEL_go"]}},
        "slider": {"model_name": "IntSliderModel", "state": {
            "description": "token", "value": 3, "min": 0, "max": 7}},
        "pick": {"model_name": "DropdownModel", "state": {
            "description": "preset", "_options_labels": ["tiny", "kimi-k3"], "index": 1}},
        "tick": {"model_name": "CheckboxModel", "state": {"description": "fuse", "value": True}},
        "go": {"model_name": "ButtonModel", "state": {"description": "measure"}},
        "out": {"model_name": "OutputModel", "state": {"outputs": [
            {"output_type": "display_data", "data": {"image/png": PNG}, "metadata": {}},
            {"output_type": "display_data", "metadata": {},
             "data": {"text/html": "<table><tr><td>square 9</td></tr></table>"}},
            {"output_type": "stream", "name": "stdout", "text": "a <note>\n"}]}},
    }
    if with_state:
        nb.metadata["widgets"] = {widgets.STATE_MIME: {"version_major": 2, "version_minor": 0,
                                                       "state": state}}
    return nb


def test_stand_in_draws_the_saved_state():
    nb = _notebook()
    assert widgets.stand_ins(nb) == 1
    data = nb.cells[0].outputs[0]["data"]
    assert widgets.VIEW_MIME not in data
    page = data["text/html"]
    assert "Interactive in JupyterLab" in page and "k3lab-widget" in page
    assert "type='range' disabled" in page and "value='3'" in page and "(0..7)" in page
    assert "<option selected>kimi-k3</option>" in page
    assert "type='checkbox' disabled checked" in page and "fuse" in page
    assert "<button disabled>measure</button>" in page
    assert f"data:image/png;base64,{PNG}" in page and "square 9" in page
    assert "a &lt;note&gt;" in page


def test_stand_in_without_saved_state_shows_the_text_fallback():
    nb = _notebook(with_state=False)
    assert widgets.stand_ins(nb) == 1
    page = nb.cells[0].outputs[0]["data"]["text/html"]
    assert "Interactive in JupyterLab" in page and "VBox(children=...)" in page


def test_report_html_shows_the_stand_in_and_loads_no_widget_manager():
    nb = _notebook()
    page = report.to_html(nb, title="w")
    assert "Interactive in JupyterLab" in page and "square 9" in page
    assert widgets.VIEW_MIME not in page and "unpkg" not in page and "cdn" not in page.lower()
    assert widgets.VIEW_MIME in nb.cells[0].outputs[0]["data"]  # the caller's copy untouched
