"""Plots for `scalegp kde --plot` and `scalegp gp fit --plot` (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import contextlib
import io
from typing import Callable

import numpy as np

from .common import CLIError

GRID = 200  # points per axis: a smooth curve or a 200 x 200 image


def require_matplotlib(data_dims: int | None = None):
    """Checks before any work that a plot can be made: matplotlib importable and, when
    ``data_dims`` is given (a density), 1-D or 2-D data."""
    if data_dims is not None and data_dims not in (1, 2):
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


@contextlib.contextmanager
def _figure():
    """A figure and its axes, closed afterwards (pyplot keeps every open figure)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=120)
    try:
        yield fig, ax
    finally:
        plt.close(fig)


def _png(fig, ax, title: str) -> bytes:
    ax.set_title(title)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def density_png(data: np.ndarray, columns: list[str],
                log_density: Callable[[np.ndarray], np.ndarray], title: str) -> bytes:
    """Draws the density with the data points; returns the PNG file's bytes.

    data: (n, 1) or (n, 2) in raw units; log_density maps (k, d) points to (k,) log-densities.
    """
    with _figure() as (fig, ax):
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
        return _png(fig, ax, title)


def regression_png(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                   predict: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
                   feature: str, target: str, title: str) -> bytes:
    """Draws a one-feature regression: the training and held-out points, the predicted mean
    over a grid and its 95% band (mean ± 1.96 std); returns the PNG file's bytes.

    train, test: (x, y) pairs of 1-D arrays (test may be empty); predict maps a 1-D grid to
    the (mean, std) there.
    """
    grid = _grid_axis(np.concatenate([train[0], test[0]]))
    mean, std = predict(grid)
    with _figure() as (fig, ax):
        ax.fill_between(grid, mean - 1.96 * std, mean + 1.96 * std, color="C0", alpha=0.2,
                        lw=0, label="95% band")
        ax.plot(grid, mean, color="C0", lw=2, label="mean")
        # Small markers: a fit may have many points, and the curve must stay visible.
        ax.plot(*train, ".", color="k", ms=3, alpha=0.6, label=f"training ({len(train[0]):,})")
        if len(test[0]):
            ax.plot(*test, ".", color="C3", ms=4, alpha=0.8,
                    label=f"held-out ({len(test[0]):,})")
        ax.set_xlabel(feature)
        ax.set_ylabel(target)
        ax.legend(loc="best", fontsize="small")
        return _png(fig, ax, title)
