"""Density plots for `scalegp kde --plot` (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import io
from typing import Callable

import numpy as np

from .common import CLIError

GRID = 200  # points per axis: a smooth curve or a 200 x 200 image


def require_matplotlib(data_dims: int):
    """Checks before any work that a plot can be made: 1-D or 2-D data, matplotlib importable."""
    if data_dims not in (1, 2):
        raise CLIError(f"--plot draws 1-D or 2-D data; this data has {data_dims} columns: choose "
                       "one or two with --columns")
    try:
        import matplotlib
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'scalegp[plot]'") from None
    matplotlib.use("Agg")


def _grid_axis(values: np.ndarray) -> np.ndarray:
    low, high = values.min(), values.max()
    pad = 0.1 * (high - low) if high > low else 1.0
    return np.linspace(low - pad, high + pad, GRID)


def density_png(data: np.ndarray, columns: list[str],
                log_density: Callable[[np.ndarray], np.ndarray], title: str) -> bytes:
    """Draws the density with the data points; returns the PNG file's bytes.

    data: (n, 1) or (n, 2) in raw units; log_density maps (k, d) points to (k,) log-densities.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=120)
    try:
        if data.shape[1] == 1:
            grid = _grid_axis(data[:, 0])
            ax.plot(grid, np.exp(log_density(grid[:, None])), color="C0", lw=2)
            ax.plot(data[:, 0], np.zeros(len(data)), "|", color="k", alpha=0.4, ms=12)
            ax.set_xlabel(columns[0])
            ax.set_ylabel("density")
        else:
            gx, gy = _grid_axis(data[:, 0]), _grid_axis(data[:, 1])
            mesh = np.stack(np.meshgrid(gx, gy), axis=-1).reshape(-1, 2)
            density = np.exp(log_density(mesh)).reshape(GRID, GRID)
            image = ax.contourf(gx, gy, density, levels=14, cmap="viridis")
            fig.colorbar(image, ax=ax, label="density")
            ax.scatter(data[:, 0], data[:, 1], s=4, c="w", edgecolors="k", linewidths=0.3,
                       alpha=0.8)
            ax.set_xlabel(columns[0])
            ax.set_ylabel(columns[1])
        ax.set_title(title)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
    finally:
        plt.close(fig)
    return buffer.getvalue()
