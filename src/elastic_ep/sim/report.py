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


def save_plot(path: str, draw: Callable[[Any], None], size_in: tuple[float, float] = (8.0, 4.5)) -> None:
    """Draw into one figure with `draw(ax)` and write it to `path` (Agg, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    target = Path(path)
    if not target.parent.is_dir():
        raise SimulationError(f"--plot {path}: folder {target.parent} does not exist")
    fig, ax = plt.subplots(figsize=size_in)
    try:
        draw(ax)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(target, dpi=120)
    finally:
        plt.close(fig)
