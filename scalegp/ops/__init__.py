"""The engine: memory-linear RBF kernel reductions and their exact gradients.

- `rbf_kernel_mv`: ``K(x1, x2) @ v`` without forming K.
- `rbf_kde_density`: Gaussian KDE (log-)density at arbitrary points.
- `available_implementations`, `auto_config`: what runs on this backend and what ``impl="auto"``
  picks.
"""

from scalegp.ops.dispatch import (
    IMPLEMENTATIONS,
    auto_config,
    available_implementations,
    rbf_kde_density,
    rbf_kernel_mv,
)
from scalegp.ops.tiling import BlockSizes

__all__ = [
    "IMPLEMENTATIONS",
    "BlockSizes",
    "auto_config",
    "available_implementations",
    "rbf_kde_density",
    "rbf_kernel_mv",
]
