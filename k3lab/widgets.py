"""Widgets in a rendered report: a static stand-in drawn from the widget state the run saved.

An ipywidgets output of an executed notebook is a reference to a model (``model_id``) whose
state nbclient stores in the notebook's metadata; a page without the widget manager (which the
report template leaves out: it loads from a CDN) shows nothing for it. :func:`stand_ins`
replaces each such output, in the page's copy of the notebook, by HTML drawn from that state: the
controls as they stood (disabled), an ``Output`` widget's captured outputs (figures, tables,
text) as they were shown, and a line saying the widget is interactive in JupyterLab.
"""

from __future__ import annotations

import html
import json
from typing import Any

__all__ = ["VIEW_MIME", "STATE_MIME", "NOTE", "present", "stand_ins", "render"]

VIEW_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
NOTE = ("Interactive in JupyterLab (open the executed notebook there to use it); shown here as "
        "the run left it, controls disabled.")
_BOX = ("VBoxModel", "BoxModel", "GridBoxModel", "HBoxModel", "AccordionModel", "TabModel",
        "StackModel")
_STYLE = ("border:1px dashed #888;border-radius:4px;padding:6px 10px;margin:6px 0;"
          "background:#fafafa")


def _text(v: Any) -> str:
    return "".join(v) if isinstance(v, list) else str(v)


def _output_html(out: dict) -> str:
    """One captured output (nbformat dict) as HTML: an image, HTML, or text."""
    kind = out.get("output_type")
    if kind == "stream":
        return f"<pre>{html.escape(_text(out.get('text', '')))}</pre>"
    if kind == "error":
        return (f"<pre style='color:#b00'>{html.escape(str(out.get('ename')))}: "
                f"{html.escape(str(out.get('evalue')))}</pre>")
    data = out.get("data", {})
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            src = _text(data[mime]).replace("\n", "")
            return f"<img alt='figure' src='data:{mime};base64,{src}'>"
    if "image/svg+xml" in data:
        return _text(data["image/svg+xml"])
    if "text/html" in data:
        return _text(data["text/html"])
    if "text/plain" in data:
        return f"<pre>{html.escape(_text(data['text/plain']))}</pre>"
    return ""


def _label(s: dict) -> str:
    d = s.get("description") or ""
    return f"<label style='margin-right:6px'>{html.escape(str(d))}</label>" if d else ""


def _ref(v: Any) -> str | None:
    return v[len("IPY_MODEL_"):] if isinstance(v, str) and v.startswith("IPY_MODEL_") else None


def render(model_id: str, state: dict, depth: int = 0) -> str:
    """The static HTML of widget ``model_id`` and its children from ``state`` (model id ->
    {"model_name", "state"})."""
    model = state.get(model_id)
    if model is None or depth > 20:
        return "<span class='k3lab-small'>(widget state not saved)</span>"
    name, s = model.get("model_name", ""), model.get("state", {})
    if name in _BOX:
        row = name == "HBoxModel"
        kids = "".join(render(r, state, depth + 1) for r in map(_ref, s.get("children", []))
                       if r)
        flex = "row;gap:12px;align-items:center" if row else "column;gap:4px"
        return f"<div style='display:flex;flex-direction:{flex}'>{kids}</div>"
    if name == "OutputModel":
        return "<div class='k3lab-widget-output'>" + "".join(
            _output_html(o) for o in s.get("outputs", [])) + "</div>"
    if name.endswith("SliderModel") or name.endswith("ProgressModel"):
        value = s.get("value")
        lo, hi = s.get("min", 0), s.get("max", 100)
        if isinstance(value, list):  # a range slider
            shown = " .. ".join(map(str, value))
            value = value[0]
        else:
            shown = str(value)
        return (f"<div>{_label(s)}<input type='range' disabled min='{html.escape(str(lo))}' "
                f"max='{html.escape(str(hi))}' value='{html.escape(str(value))}'> "
                f"<b>{html.escape(shown)}</b> <span class='k3lab-small'>({html.escape(str(lo))}"
                f"..{html.escape(str(hi))})</span></div>")
    if name in ("DropdownModel", "SelectModel", "RadioButtonsModel", "ToggleButtonsModel",
                "SelectionSliderModel"):
        labels, index = s.get("_options_labels", []), s.get("index")
        opts = "".join(f"<option{' selected' if i == index else ''}>{html.escape(str(o))}"
                       "</option>" for i, o in enumerate(labels))
        return f"<div>{_label(s)}<select disabled>{opts}</select></div>"
    if name in ("CheckboxModel", "ToggleButtonModel", "ValidModel"):
        checked = " checked" if s.get("value") else ""
        return (f"<div><input type='checkbox' disabled{checked}> "
                f"{html.escape(str(s.get('description') or ''))}</div>")
    if name == "ButtonModel":
        return f"<button disabled>{html.escape(str(s.get('description') or 'button'))}</button>"
    if name in ("TextModel", "IntTextModel", "FloatTextModel", "BoundedIntTextModel",
                "BoundedFloatTextModel", "PasswordModel", "TextareaModel", "ComboboxModel"):
        return (f"<div>{_label(s)}<input disabled value='"
                f"{html.escape(str(s.get('value', '')), quote=True)}'></div>")
    if name in ("HTMLModel", "HTMLMathModel"):
        return f"<div>{_text(s.get('value', ''))}</div>"
    if name == "LabelModel":
        return f"<div>{html.escape(str(s.get('value', '')))}</div>"
    if name == "ImageModel":
        return "<span class='k3lab-small'>(image widget)</span>"
    return f"<span class='k3lab-small'>({html.escape(name.removesuffix('Model'))})</span>"


def _state(nb) -> dict:
    widgets = nb.get("metadata", {}).get("widgets", {}) or {}
    state = widgets.get(STATE_MIME, {})
    if isinstance(state, str):
        state = json.loads(state)
    return state.get("state", {}) if isinstance(state, dict) else {}


def present(nb) -> bool:
    """Whether ``nb`` has a widget output or saved widget state."""
    return bool(nb.get("metadata", {}).get("widgets")) or any(
        VIEW_MIME in out.get("data", {}) for cell in nb.get("cells", [])
        if cell.get("cell_type") == "code" for out in cell.get("outputs", []))


def stand_ins(nb) -> int:
    """Replace every widget output of ``nb`` (in place) by its static stand-in (see the
    module); returns how many were replaced."""
    state, count = _state(nb), 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data", {})
            view = data.get(VIEW_MIME)
            if view is None:
                continue
            if isinstance(view, str):
                view = json.loads(view)
            model_id = view.get("model_id")
            body = (render(model_id, state) if model_id in state else
                    f"<pre>{html.escape(_text(data.get('text/plain', 'a widget')))}</pre>")
            data.pop(VIEW_MIME)
            data["text/html"] = (f"<div class='k3lab-widget' style='{_STYLE}'>"
                                 f"<div class='k3lab-widget-note' style='font-size:85%;"
                                 f"color:#555;margin-bottom:4px'>&#9881; {html.escape(NOTE)}"
                                 f"</div>{body}</div>")
            count += 1
    return count
