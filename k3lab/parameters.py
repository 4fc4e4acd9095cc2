"""Notebook parameters: what a notebook's ``parameters`` cell declares and the contract its
comments state, read with :func:`papermill.inspect_notebook`, and the checks of given values.

A parameter's comment may state its contract, checked before anything runs::

    preset = "tiny"          # one of: kimi-k3, kimi-k2, kimi-linear, tiny
    M = 1                    # decode tokens; range: 1..16
    sweep_tokens = []        # type: list[int] range: 1..64; []: the device's default sweep

``one of: A, B`` lists the allowed values (up to a ``;``, a `` (`` or the end; ``A | B``
opening the comment says the same); ``range: LO..HI``
bounds a number inclusively (either end may be left out); both apply to each item of a list.
``type: list[int]`` (papermill's type comment, first in the comment) types the items of a list
whose default is empty. Comments must not contain ``=``: papermill skips such a line.
"""

from __future__ import annotations

import ast
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Param", "declared", "notebook_parameters", "coerce", "check", "validate"]

_ONE_OF = re.compile(r"\bone of:\s*([^;(]+)")
# the older spelling "a | b | c" opening the comment (words, each with an optional "(note)")
_WORD = r"[\w.+-]+(?:\s*\([^)]*\))?"
_PIPES = re.compile(rf"^\s*({_WORD}(?:\s*\|\s*{_WORD})+)")
_RANGE = re.compile(r"\brange:\s*(-?[\d.]+(?:e-?\d+)?)?\s*\.\.\s*(-?[\d.]+(?:e-?\d+)?)?")
_ITEM_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


class _Expr(str):
    """A parameter default that is an expression, not a literal (no type check for it)."""

    def __repr__(self) -> str:
        return str(self)


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _Expr(text)


def _number(text: str | None) -> float | int | None:
    if text is None:
        return None
    value = ast.literal_eval(text)
    return value


@dataclass(frozen=True)
class Param:
    """One declared parameter: its default, its comment and the contract the comment states."""

    name: str
    default: Any
    help: str = ""
    item_type: type | None = None  # of a list's items, from `# type: list[int]` or the default
    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    read_by_papermill: bool = True

    @classmethod
    def from_comment(cls, name: str, default_src: str, help_text: str = "",
                     type_name: str | None = None, read_by_papermill: bool = True) -> Param:
        default = _literal(default_src)
        choices = low = high = None
        m = _ONE_OF.search(help_text)
        pipes = None if m else _PIPES.match(help_text)
        if m or pipes:
            items = ([s.strip() for s in m.group(1).split(",") if s.strip()] if m else
                     [re.sub(r"\(.*", "", s).strip() for s in pipes.group(1).split("|")])
            choices = tuple(v if not isinstance(v := _literal(s), _Expr) else str(s)
                            for s in items)
        m = _RANGE.search(help_text)
        if m:
            try:
                low, high = _number(m.group(1)), _number(m.group(2))
            except (ValueError, SyntaxError) as exc:
                raise ValueError(f"parameter {name!r}: cannot read {m.group(0)!r}") from exc
        item_type = None
        tm = re.fullmatch(r"(?:list|tuple)\[(\w+)\]", (type_name or "").strip())
        if tm:
            item_type = _ITEM_TYPES.get(tm.group(1))
        elif isinstance(default, list | tuple) and default:
            kinds = {type(v) for v in default}
            if len(kinds) == 1 and next(iter(kinds)) in _ITEM_TYPES.values():
                item_type = next(iter(kinds))
            elif kinds == {int, float}:
                item_type = float
        return cls(name, default, help_text, item_type, choices, low, high, read_by_papermill)

    def contract(self) -> str:
        """The contract in words ("" when the comment states none)."""
        parts = []
        if self.item_type is not None:
            parts.append(f"list of {self.item_type.__name__}")
        if self.choices is not None:
            parts.append("one of " + ", ".join(map(str, self.choices)))
        if self.low is not None or self.high is not None:
            parts.append(f"range {'' if self.low is None else self.low}.."
                         f"{'' if self.high is None else self.high}")
        return "; ".join(parts)


def _parameters_cell(nb) -> str | None:
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            return cell.source
    return None


def _assigned(source: str, path: Path) -> dict[str, str]:
    """name -> default source of every top-level assignment of the cell, in order."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"{path.name}: cannot parse the parameters cell: {exc}") from exc
    names = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            names[target.id] = ast.get_source_segment(source, value) or ""
    return names


def declared(path: str | os.PathLike) -> dict[str, Param]:
    """name -> :class:`Param` of the notebook's ``parameters`` cell ({} without one).

    papermill reads the names, defaults and comments; a line it cannot read (a comment holding
    ``=``) still declares its parameter, with its default and no comment
    (``read_by_papermill`` False), so the notebook keeps running while its cell is fixed.
    """
    import logging

    import nbformat
    import papermill

    path = Path(path)
    source = _parameters_cell(nbformat.read(path, as_version=4))
    if source is None:
        return {}
    assigned = _assigned(source, path)
    log = logging.getLogger("papermill")
    level = log.level
    log.setLevel(logging.ERROR)  # its "Unable to parse line" is reported through Param
    try:
        found = papermill.inspect_notebook(str(path))
    finally:
        log.setLevel(level)
    params = {}
    for name, src in assigned.items():
        info = found.get(name)
        try:
            if info is None:
                params[name] = Param.from_comment(name, src, read_by_papermill=False)
            else:
                type_name = info.get("inferred_type_name")
                params[name] = Param.from_comment(
                    name, info["default"], info.get("help") or "",
                    None if type_name in (None, "None") else type_name)
        except ValueError as exc:
            raise ValueError(f"{path.stem}: {exc}") from None
    return params


def notebook_parameters(path: str | os.PathLike) -> dict[str, Any]:
    """name -> default of the notebook's ``parameters`` cell ({} without one)."""
    return {k: p.default for k, p in declared(path).items()}


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(v: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", tuple: "list",
            dict: "dict"}.get(type(v), type(v).__name__)


def _item(name: str, i: int, v: Any, kind: type) -> Any:
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if not ok:
        raise ValueError(f"parameter {name!r}: item {i} must be {kind.__name__}, got {v!r}")
    return v


def coerce(name: str, value: Any, default: Any, item_type: type | None = None) -> Any:
    """``value`` checked against (and converted to) the type of ``default``.

    Strings (as they come from ``-p KEY=VALUE``) are parsed for non-string defaults: bool from
    true/false/1/0/yes/no, int, float, list ("[1, 2, 4]" or "1,2,4"), dict. A value of another
    type, a list item of another type than ``item_type`` or a float that is not finite raises
    ValueError naming the parameter.
    """
    if default is None or isinstance(default, _Expr):
        if isinstance(value, str):
            try:
                return ast.literal_eval(value)
            except (ValueError, SyntaxError):
                return value
        return value
    kind = _type_name(default)

    def bad(why: str = "") -> ValueError:
        return ValueError(f"parameter {name!r}: expected {kind} (default {default!r}), "
                          f"got {value!r}{why}")

    if isinstance(value, str) and kind != "str":
        text = value.strip()
        if kind == "bool":
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise bad()
        try:
            if kind == "int":
                return int(text)
            if kind == "float":
                value = float(text)
            else:
                if kind == "list" and not text.startswith(("[", "(")):
                    text = f"[{text}]"
                value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise bad() from exc
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
        if ok and not math.isfinite(value):
            raise bad(" (not a finite number)")
    elif kind == "list":
        ok = isinstance(value, list | tuple)
        value = list(value) if ok else value
        if ok and item_type is not None:
            value = [_item(name, i, v, item_type) for i, v in enumerate(value)]
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise bad()
    return value


def _within(p: Param, v: Any, where: str) -> None:
    if p.choices is not None and v not in p.choices:
        raise ValueError(f"parameter {p.name!r}{where}: {v!r} is not allowed; one of: "
                         f"{', '.join(map(str, p.choices))}")
    if p.low is None and p.high is None:
        return
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"parameter {p.name!r}{where}: expected a number, got {v!r}")
    if (p.low is not None and v < p.low) or (p.high is not None and v > p.high):
        raise ValueError(f"parameter {p.name!r}{where}: {v!r} is out of range "
                         f"{'' if p.low is None else p.low}..{'' if p.high is None else p.high}")


def check(p: Param, value: Any) -> Any:
    """``value`` coerced to ``p``'s type and checked against its contract (ValueError)."""
    value = coerce(p.name, value, p.default, p.item_type)
    if isinstance(value, list) and not isinstance(p.default, _Expr | type(None)):
        for i, v in enumerate(value):
            _within(p, v, f" item {i}")
    else:
        _within(p, value, "")
    return value


def validate(path: str | os.PathLike, params: dict,
             decl: dict[str, Param] | None = None) -> dict:
    """``params`` checked against the notebook's parameters; returns them coerced.

    Unknown key: ValueError naming it and the allowed keys. Wrong type or a value outside the
    contract: ValueError naming the notebook, the parameter and what is allowed.
    """
    decl = declared(path) if decl is None else decl
    name = Path(path).stem
    unknown = [k for k in params if k not in decl]
    if unknown:
        raise ValueError(f"{name}: unknown parameter {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(decl) or '(none)'}")
    try:
        return {k: check(decl[k], v) for k, v in params.items()}
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
