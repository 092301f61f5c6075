"""Request traces for the autoscaler's simulator: one file per pool, arrivals with prompt and output lengths.

Two formats, told apart by the file's first line:

* the Azure LLM inference traces (``../shared/traces/AzureLLMInferenceTrace_*.csv``): a header
  ``TIMESTAMP,ContextTokens,GeneratedTokens``, then rows ``2023-11-16 18:17:03.9799600,4808,10``
  (wall clock, any number of fractional digits; prompt tokens; generated tokens);
* JSON lines: one object a line, ``{"timestamp": <ms>, "input_length": N, "output_length": M}``.

Every pool's file is loaded against one time origin, the earliest arrival of all of them, so traces of
the same real hour keep their relative timing. ``speedup`` K divides every arrival time (the hour in
60/K minutes); ``token_scale`` S divides every length (rounded, at least one token), for a small model.
A bad row raises :class:`TraceError` naming the file, the line and the value.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A trace file that cannot be read: the message names the file, the line and what is wrong."""


@dataclass(frozen=True, order=True)
class TraceRequest:
    """One request of a trace, as the simulator replays it."""

    arrival_s: float  # seconds after the traces' common origin, after speedup
    pool: str  # the pool whose file it came from
    prompt_tokens: int  # after token_scale, >= 1
    output_tokens: int  # after token_scale, >= 1


@dataclass(frozen=True)
class _Row:
    t_s: float  # absolute seconds (epoch for the CSV, the file's own ms / 1000 for JSON lines)
    prompt: int
    output: int


def default_traces_dir() -> Path:
    """``$DELTASERVE_TRACES_DIR``, else ``shared/traces`` beside the checkout (``../shared/traces``)."""
    env = os.environ.get("DELTASERVE_TRACES_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def _parse_timestamp(text: str) -> float:
    """``2023-11-16 18:17:03.9799600`` (UTC, any number of fractional digits) -> epoch seconds."""
    base, _, frac = text.strip().partition(".")
    whole = datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
    if frac and not frac.isdigit():
        raise ValueError(f"fraction {frac!r} is not digits")
    return whole + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _length(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return int(value)


def _read_csv(path: Path, lines: list[str]) -> list[_Row]:
    header = tuple(c.strip() for c in lines[0].split(","))
    if header != AZURE_HEADER:
        raise TraceError(f"{path}:1: expected the header {','.join(AZURE_HEADER)}, got {lines[0].strip()!r}")
    rows = []
    for no, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cells = line.split(",")
        try:
            if len(cells) != 3:
                raise ValueError(f"expected 3 columns, got {len(cells)}")
            rows.append(_Row(_parse_timestamp(cells[0]), _length(cells[1].strip(), "ContextTokens"),
                             _length(cells[2].strip(), "GeneratedTokens")))
        except ValueError as e:
            raise TraceError(f"{path}:{no}: {e} (row {line.strip()!r})") from None
    return rows


def _read_jsonl(path: Path, lines: list[str]) -> list[_Row]:
    rows = []
    for no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError(f"expected an object, got {type(obj).__name__}")  # noqa: TRY004 (reported as a bad row)
            missing = [k for k in ("timestamp", "input_length", "output_length") if k not in obj]
            if missing:
                raise ValueError(f"missing {', '.join(missing)}")
            ts = obj["timestamp"]
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
                raise ValueError(f"timestamp must be a non-negative number of milliseconds, got {ts!r}")
            rows.append(_Row(ts / 1000.0, _length(obj["input_length"], "input_length"),
                             _length(obj["output_length"], "output_length")))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            raise TraceError(f"{path}:{no}: {e}") from None
    return rows


def read_rows(path: str | Path) -> list[_Row]:
    """The file's rows in file order (absolute times, raw lengths). Raises TraceError."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"{path}: cannot read the trace: {e.strerror}") from None
    if not lines or not lines[0].strip():
        raise TraceError(f"{path}:1: empty trace")
    rows = _read_jsonl(path, lines) if lines[0].lstrip().startswith("{") else _read_csv(path, lines)
    if not rows:
        raise TraceError(f"{path}: no requests")
    return rows


def _scaled(n: int, token_scale: float) -> int:
    return max(1, round(n / token_scale))


def load_traces(files: Mapping[str, str | Path], *, speedup: float = 1.0, token_scale: float = 1.0) -> list[TraceRequest]:
    """Every pool's requests, merged and sorted by arrival, on one time origin (the earliest row of all files).

    ``files``: pool name -> trace file. ``speedup`` > 0 divides arrival times; ``token_scale`` > 0 divides prompt and
    output lengths (each rounded, at least 1)."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup!r}")
    if not token_scale > 0:
        raise ValueError(f"token_scale must be > 0, got {token_scale!r}")
    if not files:
        raise ValueError("no trace files given")
    rows = {pool: read_rows(path) for pool, path in files.items()}
    origin = min(r.t_s for pool_rows in rows.values() for r in pool_rows)
    out = [
        TraceRequest((r.t_s - origin) / speedup, pool, _scaled(r.prompt, token_scale), _scaled(r.output, token_scale))
        for pool, pool_rows in rows.items() for r in pool_rows
    ]
    out.sort()
    return out


def parse_trace_args(specs: list[str]) -> dict[str, Path]:
    """``["standard=FILE", "highspeed=FILE"]`` (the CLI's ``--trace``) -> {pool: path}; names the bad spec."""
    files: dict[str, Path] = {}
    for spec in specs:
        pool, sep, path = spec.partition("=")
        if not sep or not pool or not path:
            raise ValueError(f"--trace must be POOL=FILE, got {spec!r}")
        if pool in files:
            raise ValueError(f"--trace {pool} given twice")
        files[pool] = Path(path)
    return files
