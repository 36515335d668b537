"""Output for the sim and plan commands: aligned text tables, JSON, and matplotlib figures."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from elastic_ep.errors import SimulationError


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Columns right-aligned except the first, under a header line."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        first, *rest = cells
        return "  ".join(
            [str(first).ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(rest, widths[1:], strict=True)]
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def jsonable(value: Any) -> Any:
    """Dataclasses, numpy arrays and scalars as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def dumps(value: Any) -> str:
    return json.dumps(jsonable(value), indent=1)


def mark_coinciding(ax: Any) -> dict[str, str]:
    """Keep every line visible where lines coincide: of lines with the same points, each drawn
    later lies on top of the earlier ones, narrower, with hollow markers, and its label says
    which line it shares (the first). Returns {label: the label of the first line it shares}."""
    groups: list[list[Any]] = []
    for line in ax.get_lines():
        x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
        group = next((g for g in groups if _same_points(g[0], x, y)), None)
        if group is None:
            groups.append([line])
        else:
            group.append(line)
    shared = {}
    for group in (g for g in groups if len(g) > 1):
        base_width, base_z = min(line.get_linewidth() for line in group), max(line.get_zorder() for line in group)
        for k, line in enumerate(group):
            line.set_linewidth(base_width + 3 * (len(group) - 1 - k))
            line.set_zorder(base_z + k)
            if k == 0:
                continue
            if line.get_marker() in (None, "", "None", " "):
                line.set_marker("o")
            line.set_markerfacecolor("none")
            line.set_markersize(max(line.get_markersize(), 7))
            shared[line.get_label()] = group[0].get_label()
            line.set_label(f"{line.get_label()} (same as {group[0].get_label()})")
    return shared


def _same_points(line: Any, x: np.ndarray, y: np.ndarray) -> bool:
    lx, ly = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
    return lx.shape == x.shape and np.allclose(lx, x, equal_nan=True) and np.allclose(ly, y, equal_nan=True)


def save_plot(path: str, draw: Callable[[Any], None], size_in: tuple[float, float] = (8.0, 4.5),
              legend: dict[str, Any] | None = None) -> None:
    """Draw into one figure with `draw(ax)` and write it to `path` (Agg, no display needed);
    lines that coincide are marked (`mark_coinciding`), then the legend is drawn with `legend`
    (keyword arguments of `ax.legend`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(path)
    if not target.parent.is_dir():
        raise SimulationError(f"--plot {path}: folder {target.parent} does not exist")
    fig, ax = plt.subplots(figsize=size_in)
    try:
        draw(ax)
        mark_coinciding(ax)
        ax.legend(**(legend or {}))
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(target, dpi=120)
    finally:
        plt.close(fig)
