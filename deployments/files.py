"""Reading the operator's YAML / JSON files (the platform config, the tenants file) with errors of one line that
name the file and, for a syntax error, its line and column."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from pydantic import ValidationError

_UNSHOWN = ("url", "endpoint", "key", "token", "password", "secret")  # fields whose values a message does not repeat


def yaml_problem(e: yaml.YAMLError) -> str:
    """``e`` in one line: what the parser expected and where (line and column from 1)."""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    mark = getattr(e, "problem_mark", None)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def read_mapping(path: str | Path, what: str) -> dict:
    """The mapping in the YAML file ``path`` (JSON when it ends in .json); empty file: {}. ValueError naming
    ``what`` and the file when it cannot be read, does not parse, or holds something other than a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read {what} {str(path)!r}: {e.strerror or e}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{what} {path}: not valid YAML: {yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path}: expected a mapping of settings, got a {type(data).__name__}")
    return data


def validation_text(e: ValidationError, *, values: bool = True) -> str:
    """The errors of ``e`` in one line, ``field.path: what is wrong`` joined by "; " (pydantic's own report spans
    lines and links its documentation); ``values``: with `` (got VALUE)`` after each, except for the values of
    URL, key, token and password fields (they may hold credentials)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        if values and value is not None and not isinstance(value, (dict, list)) \
                and not any(w in loc.lower() for w in _UNSHOWN):
            msg += f" (got {value!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
