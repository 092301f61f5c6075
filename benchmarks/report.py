"""Shared writer for benchmark results: one JSON, one markdown table and one PNG per benchmark.

Usage from a benchmark script (run from the repository root)::

    from benchmarks.report import write_report

    rows = [{"shape": "T=4096", "naive_ms": 812.0, "chunk_ms": 41.5, "speedup": 19.6}]
    write_report(
        "kda_chunk",
        rows,
        columns=["shape", "naive_ms", "chunk_ms", "speedup"],
        plot={"x": "shape", "y": ["naive_ms", "chunk_ms"], "kind": "bar", "logy": True, "ylabel": "ms"},
        command=".venv/bin/python benchmarks/bench_kda_chunk.py",
    )

This writes ``benchmarks/results/kda_chunk.{json,md,png}``. ``plot`` is either a spec dict
(keys: ``x`` column for the x axis, ``y`` list of columns, ``kind`` "bar" or "line", optional ``logy``,
``xlabel``, ``ylabel``, ``title``) or a callable ``plot(ax, rows)`` drawing on a matplotlib Axes.
"""

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):
        env["loadavg_1m"] = round(os.getloadavg()[0], 2)
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return env


def _plot_spec(ax: Any, rows: list[dict], spec: dict) -> None:
    xs = [_fmt(row[spec["x"]]) for row in rows]
    ys = spec["y"]
    if spec.get("kind", "bar") == "bar":
        width = 0.8 / len(ys)
        for i, col in enumerate(ys):
            pos = [j + (i - (len(ys) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(pos, [row[col] for row in rows], width, label=col)
        ax.set_xticks(range(len(rows)), xs)
    else:
        for col in ys:
            ax.plot(xs, [row[col] for row in rows], marker="o", label=col)
    if spec.get("logy"):
        ax.set_yscale("log")
    ax.set_xlabel(spec.get("xlabel", spec["x"]))
    ax.set_ylabel(spec.get("ylabel", ""))
    ax.legend()


def write_report(
    name: str,
    rows: list[dict],
    columns: Sequence[str] | None = None,
    plot: Callable[[Any, list[dict]], None] | dict | None = None,
    command: str = "",
    title: str | None = None,
    notes: str = "",
    out_dir: Path | str = RESULTS_DIR,
) -> dict[str, Path]:
    """Write ``<out_dir>/<name>.json``, ``.md`` and (when ``plot`` is given) ``.png``.

    Args:
        name: file stem, e.g. "kda_chunk".
        rows: one dict per measurement; values should be JSON-serialisable.
        columns: columns (and order) of the markdown table; default: keys of the first row.
        plot: spec dict or ``callable(ax, rows)`` (see the module docstring); None skips the PNG.
        command: shell command that reproduces the results, recorded in the JSON and markdown.
        title: markdown heading and plot title; default ``name``.
        notes: free text placed under the table.
        out_dir: destination folder, created if missing; default ``benchmarks/results``.

    Returns:
        Paths written, keyed by "json", "md" and "png".
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = list(columns if columns is not None else (rows[0].keys() if rows else []))
    title = title or name
    paths = {"json": out_dir / f"{name}.json", "md": out_dir / f"{name}.md"}

    record = {"name": name, "title": title, "command": command, "columns": columns, "rows": rows,
              "notes": notes, "environment": _environment()}
    paths["json"].write_text(json.dumps(record, indent=2, default=str) + "\n")

    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(col, "")) for col in columns) + " |" for row in rows]
    if notes:
        lines += ["", notes]
    if command:
        lines += ["", "Reproduce:", "", "```", command, "```"]
    paths["md"].write_text("\n".join(lines) + "\n")

    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        if callable(plot):
            plot(ax, rows)
        else:
            _plot_spec(ax, rows, plot)
        ax.set_title(title)
        fig.tight_layout()
        paths["png"] = out_dir / f"{name}.png"
        fig.savefig(paths["png"], dpi=120)
        plt.close(fig)
    return paths
