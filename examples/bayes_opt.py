"""Bayesian optimisation of the Branin function, expected improvement maximised by gradient
through `ScalableGPRegressor.predict_fn`.

Branin on [-5, 10] x [0, 15] has its global minimum f* = 0.397887 at three points. Starting from
6 quasi-random evaluations, each round fits a GP (Matérn 5/2, ARD, on the unit square, targets
normalised) to the logarithms of the values evaluated (Branin is positive; its range, 0.4 to
300, is dominated by the corners, and log f resolves the valleys where the minima are), and
evaluates next where the expected improvement over the best so far is largest::

    EI(x) = (g_best - μ(x)) Φ(z) + σ(x) φ(z),   z = (g_best - μ(x)) / σ(x),

with μ and σ the GP's predictive mean and std of g = log f (minimising g minimises f). ``predict_fn(return_std=True)`` gives them as a
JAX function, so ``jax.value_and_grad`` of EI drives L-BFGS-B (scipy) from 64 starts at once
(random points and points near the best ones; the starts are independent, their sum is
maximised as one problem). The GP computes in float64 (``dtype="float64"``) with JAX's x64 mode
off: its methods turn it on for themselves, and the function of ``predict_fn`` runs inside
``jax.enable_x64(True)`` (EI's gradients where it is tiny need the digits). It stops once the best value is within 1e-2 of f* (the regret
``f_best - f*``, in Branin's units) and exits non-zero if that takes 30 evaluations or more.

    python examples/bayes_opt.py --plot bayes_opt.png
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import minimize
from scipy.stats import qmc
from sklearn.exceptions import ConvergenceWarning
from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel

from scalegp import ScalableGPRegressor

F_STAR = 0.397887
OPTIMA = np.array([[-np.pi, 12.275], [np.pi, 2.275], [9.42478, 2.475]])
LOW, HIGH = np.array([-5.0, 0.0]), np.array([10.0, 15.0])


def branin(x):
    """Branin on (n, 2) points of [-5, 10] x [0, 15]."""
    x1, x2 = x[:, 0], x[:, 1]
    b, c, t = 5.1 / (4 * np.pi**2), 5 / np.pi, 1 / (8 * np.pi)
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - t) * np.cos(x1) + 10


def to_domain(u):
    return LOW + u * (HIGH - LOW)


def fit_model(u, y, seed):
    kernel = (ConstantKernel(1.0, (1e-3, 1e3))
              * Matern(length_scale=[0.3, 0.3], length_scale_bounds=(1e-2, 1e1), nu=2.5)
              + WhiteKernel(1e-6, (1e-10, 1e-2)))
    model = ScalableGPRegressor(kernel=kernel, mean=0.0, normalize_y=True, dtype="float64",
                                n_restarts_optimizer=1, random_state=seed)
    with warnings.catch_warnings():  # a bound reached (the noise, at its floor) is fine here
        warnings.simplefilter("ignore", ConvergenceWarning)
        return model.fit(u, y)


def x64():
    """JAX's x64 mode on inside a ``with`` block: ``jax.enable_x64`` (jax >= 0.8), else
    ``jax.experimental.enable_x64``."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64

    return enable_x64(True)


def next_point(model, u, y, rng, starts=64):
    """The point of the unit square with the largest expected improvement, by L-BFGS-B on
    ``jax.value_and_grad`` of EI from ``starts`` starting points."""
    predict = model.predict_fn(return_std=True)
    best = float(y.min())

    def negative_ei(flat):
        mean, std = predict(flat.reshape(-1, 2))
        z = (best - mean) / std
        ei = (best - mean) * jax.scipy.stats.norm.cdf(z) + std * jax.scipy.stats.norm.pdf(z)
        return -jnp.sum(ei)

    value_and_grad = jax.jit(jax.value_and_grad(negative_ei))

    def objective(flat):
        value, grad = value_and_grad(jnp.asarray(flat))
        return float(value), np.asarray(grad, np.float64)

    near = u[np.argsort(y)[:4]]
    x0 = np.concatenate([
        rng.uniform(size=(starts - 16, 2)),
        np.clip(np.repeat(near, 4, axis=0) + 0.02 * rng.normal(size=(16, 2)), 0, 1)])
    # The starts form one separable problem of 2 * starts variables, which L-BFGS-B needs several
    # hundred iterations to converge in every start: stopped at 200, the search left the best
    # start short of its maximum, and the run missed f* + 1e-2 by 1e-3 (seed 0).
    result = minimize(objective, x0.ravel(), jac=True, method="L-BFGS-B",
                      bounds=[(0.0, 1.0)] * x0.size, options={"maxiter": 1000})
    ends = result.x.reshape(-1, 2)
    mean, std = predict(ends)
    z = (best - mean) / std
    ei = np.asarray((best - mean) * jax.scipy.stats.norm.cdf(z)
                    + std * jax.scipy.stats.norm.pdf(z))
    return ends[int(np.argmax(ei))], float(np.max(ei))


def plot(path, u, y, found_at):
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'scalegp[plot]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g1, g2 = np.meshgrid(np.linspace(-5, 10, 200), np.linspace(0, 15, 200))
    f = branin(np.column_stack([g1.ravel(), g2.ravel()])).reshape(g1.shape)
    x = to_domain(u)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.contour(g1, g2, np.log(f), levels=25, cmap="viridis", linewidths=0.7)
    left.scatter(x[:, 0], x[:, 1], c=np.arange(len(x)), cmap="autumn", s=25, zorder=3,
                 label="evaluations (early: red, late: yellow)")
    left.scatter(OPTIMA[:, 0], OPTIMA[:, 1], marker="*", s=150, c="k", label="global minima")
    left.set_xlabel("x1")
    left.set_ylabel("x2")
    left.set_title("Branin (log contours) and the points evaluated")
    left.legend(loc="upper right", fontsize=8)
    regret = np.minimum.accumulate(y) - F_STAR
    right.semilogy(np.arange(1, len(y) + 1), regret, "o-", ms=3)
    right.axhline(1e-2, color="0.5", ls="--", label="1e-2")
    right.axvline(found_at, color="C1", ls=":", label=f"reached at evaluation {found_at}")
    right.set_xlabel("evaluations")
    right.set_ylabel("best value - f*")
    right.set_title("Regret of the best value so far")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=Path("bayes_opt.png"),
                        help="where to save the plot (needs matplotlib)")
    parser.add_argument("--budget", type=int, default=29, help="evaluations at most")
    parser.add_argument("--initial", type=int, default=6, help="quasi-random evaluations first")
    parser.add_argument("--tol", type=float, default=1e-2, help="regret to reach")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    u = qmc.Halton(2, scramble=True, seed=args.seed).random(args.initial)
    y = branin(to_domain(u))
    start = time.perf_counter()
    found_at = None
    while len(y) < args.budget and found_at is None:
        model = fit_model(u, np.log(y), seed=len(y))
        with x64():
            point, ei = next_point(model, u, np.log(y), rng)
        value = branin(to_domain(point[None]))
        u, y = np.vstack([u, point]), np.append(y, value)
        regret = y.min() - F_STAR
        x1, x2 = to_domain(point)
        print(f"evaluation {len(y):2d}: f({x1:8.4f}, {x2:8.4f}) = {value[0]:9.5f}  "
              f"(EI of log f {ei:.2e}; best {y.min():.6f}, regret {regret:.1e})", flush=True)
        if regret < args.tol:
            found_at = len(y)
    best = int(np.argmin(y))
    x1, x2 = to_domain(u[best])
    print(f"best: f({x1:.5f}, {x2:.5f}) = {y[best]:.6f} "
          f"(f* = {F_STAR}), {len(y)} evaluations, {time.perf_counter() - start:.0f} s")
    if args.plot is not None:
        plot(args.plot, u, y, found_at or len(y))
    if found_at is None:
        print(f"FAILED: the best value is {y.min() - F_STAR:.2e} above f* after {len(y)} "
              f"evaluations, not within {args.tol}")
        sys.exit(1)
    print(f"within {args.tol} of f* at evaluation {found_at} (< 30)")


if __name__ == "__main__":
    main()
