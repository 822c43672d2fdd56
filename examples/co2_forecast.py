"""Forecast atmospheric CO2 with a composite kernel: the Mauna Loa example of scikit-learn, run on
ScalableGPRegressor.

Fits scikit-learn's CO2 kernel (a long-term RBF, a seasonal RBF × ExpSineSquared with a one-year
period, a RationalQuadratic for medium-term irregularities, a short RBF plus WhiteKernel for
noise) to the whole bundled weekly record (1958-2001), from scikit-learn's starting values, and
forecasts ten years past its end. Prints the fitted kernel, the log marginal likelihood and the
time, and writes a plot of the data, the fit and the forecast with its 95% band (matplotlib, the
``plot`` extra). The model computes in float64 (``dtype="float64"``, scoped to the estimator:
JAX's x64 mode stays off): this kernel's matrix (outputscale 50² against noise 0.01) is beyond
a float32 Cholesky.

    python examples/co2_forecast.py --out co2_forecast.png
"""

import argparse
import time
from pathlib import Path

import numpy as np
from sklearn.gaussian_process.kernels import RBF, ExpSineSquared, RationalQuadratic, WhiteKernel

from scalegp import ScalableGPRegressor

DATA = Path(__file__).resolve().parent / "data" / "co2_weekly.csv"


def mauna_loa_kernel():
    long_term = 50.0**2 * RBF(length_scale=50.0)
    seasonal = 2.0**2 * RBF(length_scale=100.0) * ExpSineSquared(
        length_scale=1.0, periodicity=1.0, periodicity_bounds="fixed")
    irregular = 0.5**2 * RationalQuadratic(length_scale=1.0, alpha=1.0)
    noise = 0.1**2 * RBF(length_scale=0.1) + WhiteKernel(
        noise_level=0.1**2, noise_level_bounds=(1e-5, 1e5))
    return long_term + seasonal + irregular + noise


def main():
    parser = argparse.ArgumentParser(description="CO2 forecast with a composite GP kernel")
    parser.add_argument("--out", type=Path, default=Path("co2_forecast.png"))
    parser.add_argument("--years", type=float, default=10.0, help="forecast horizon")
    args = parser.parse_args()

    table = np.loadtxt(DATA, delimiter=",", skiprows=1)
    x, y = table[:, :1], table[:, 1]
    y_mean = y.mean()
    start = time.perf_counter()
    model = ScalableGPRegressor(kernel=mauna_loa_kernel(), mean=0.0, dtype="float64")
    model.fit(x, y - y_mean)
    fit_s = time.perf_counter() - start
    print(f"{len(y)} weeks, fitted in {fit_s:.0f} s")
    print(f"kernel: {model.kernel_}")
    print(f"log marginal likelihood: {model.log_marginal_likelihood_value_:.1f}")

    grid = np.linspace(x.min(), x.max() + args.years, 1500)[:, None]
    mean, std = model.predict(grid, return_std=True)
    mean += y_mean
    end = grid[:, 0] > x.max()
    print(f"forecast for {grid[-1, 0]:.1f}: {mean[-1]:.1f} ± {1.96 * std[-1]:.1f} ppm (95%)")

    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install 'scalegp[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(x[:, 0], y, ".", ms=1.5, color="0.4", label="weekly measurements")
    ax.plot(grid[~end, 0], mean[~end], lw=1, color="C0", label="GP mean")
    ax.plot(grid[end, 0], mean[end], lw=1, color="C1", label="forecast")
    ax.fill_between(grid[:, 0], mean - 1.96 * std, mean + 1.96 * std, color="C1", alpha=0.3,
                    lw=0, label="95% band")
    ax.set_xlabel("year")
    ax.set_ylabel("CO2 (ppm)")
    ax.set_title("Mauna Loa CO2: scikit-learn's composite kernel on ScalableGPRegressor")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
