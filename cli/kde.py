"""`scalegp kde`: fit a Gaussian KDE to a file, summarise it, write densities, samples, a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from scalegp._runtime import start_backends_early

from .common import CLIError, Choice, Debug, Delimiter, Force, Json, Key, Missing, Quiet, \
    Stopwatch, parse_columns, print_summary, reports_errors, status
from .io import Outputs, Table, encode_table, read_table

#: Above this many points the summary's mean log-likelihood uses a random subset of this size
#: (scoring all n points costs n² kernel evaluations); `--out` always scores every point.
SUMMARY_POINTS = 20_000


class Scale(Choice):
    none = "none"
    standardize = "standardize"
    covariance = "covariance"


class Prune(Choice):
    auto = "auto"
    on = "on"
    off = "off"


_PRUNE = {Prune.auto: "auto", Prune.on: True, Prune.off: False}


# The KDE runs no LAPACK (its scalings factor d x d matrices with numpy): no scipy import
@reports_errors(lapack=False)
def kde_command(
    data: Annotated[Path, typer.Argument(help="Points, one per row: .npy, .npz or .csv (with a "
                                               "header). A 1-D array is points on a line.",
                                         show_default=False)],
    bandwidth: Annotated[str, typer.Option(
        help="A number (or one per column, comma-separated), 'scott', 'silverman', 'cv' "
             "(leave-one-out cross-validation) or 'cv-diag' (one per column). 'cv' is the most "
             "accurate; the rules are instant.")] = "cv",
    scale: Annotated[Scale, typer.Option(
        help="Feature scaling before smoothing: none, standardize (per column) or covariance "
             "(full whitening, as scipy's gaussian_kde).", parser=Scale.parser("--scale"))
    ] = Scale.standardize,
    columns: Annotated[Optional[str], typer.Option(
        help="Columns to use, by name or index, comma-separated (default: all).")] = None,
    key: Key = None,
    delimiter: Delimiter = None,
    missing: Missing = "error",
    query: Annotated[Optional[Path], typer.Option(
        help="Score these points instead of the data (same columns, same format options).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Write log-densities of the data (or of --query) here: .npy or .csv.")] = None,
    sample: Annotated[int, typer.Option(help="Draw this many samples from the density.",
                                        min=0)] = 0,
    sample_out: Annotated[Optional[Path], typer.Option(
        help="Where --sample writes its draws: .npy or .csv.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for cross-validation subsets and samples.")] = 0,
    prune: Annotated[Prune, typer.Option(
        help="Skip the data that cannot matter to a query (exact up to --prune-tol): auto "
             "(when it pays: many points, few columns, narrow bandwidth), on or off.",
        parser=Prune.parser("--prune"))] = Prune.auto,
    prune_tol: Annotated[Optional[float], typer.Option(
        help="With pruning, each density's skipped part is at most this fraction of it "
             "(default: float rounding, 6e-8).", min=0.0, max=0.5)] = None,
    float64: Annotated[bool, typer.Option(help="Compute in float64 (default float32).")] = False,
    plot: Annotated[Optional[Path], typer.Option(
        help="Draw the density with the points to this PNG (1-D or 2-D data; needs the plot "
             "extra).")] = None,
    json_output: Json = False,
    force: Force = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Fit a Gaussian kernel density estimate and report it.

    Examples:

      scalegp kde examples/data/us_macro_quarterly.csv --columns unemp,infl --plot kde.png

      scalegp kde points.npy --bandwidth scott --out logp.npy

      scalegp kde train.csv --query test.csv --out test_logp.csv --json

      scalegp kde data.npz --key x --sample 1000 --sample-out draws.npy --seed 0
    """
    clock = Stopwatch()
    # every run uses JAX's default device: its client starts while the library is imported
    # and the data read (a TPU's takes seconds)
    start_backends_early()
    chosen_bandwidth = _parse_bandwidth(bandwidth)
    _check_sample_options(sample, sample_out)
    table, queries = _read_points(data, query, key=key, columns=parse_columns(columns),
                                  delimiter=delimiter, missing=missing)
    outputs = Outputs(force=force, inputs=[data] + ([query] if query is not None else []))
    x = table.values
    out, sample_out, plot = _add_outputs(outputs, out, sample_out, plot, x.shape[1])
    _check_sample_memory(sample, x.shape[1], sample_out)

    from scalegp.estimators import precision_scope

    model = _Model(chosen_bandwidth, scale, seed, _PRUNE[prune], prune_tol,
                   np.float64 if float64 else np.float32)
    with precision_scope(model.dtype):
        fit_seconds = _fit(model, x, bandwidth, quiet)

        # Every result is computed before any file is written: they are published together.
        files = {}
        if out is not None:
            scored = queries.values if queries is not None else x
            with status(f"scoring {len(scored):,} points", quiet):
                log_density = model.log_density(scored)
            files[out] = encode_table(log_density, ["log_density"], out.suffix)
        if queries is None and out is not None:  # every point is scored already
            mean_loglik, mean_loglik_points = float(np.mean(log_density)), len(log_density)
        else:
            mean_loglik, mean_loglik_points = _mean_log_likelihood(model, x, seed, quiet)
        if sample:
            draws = model.fitted.sample(sample, random_state=np.random.RandomState(seed))
            files[sample_out] = encode_table(draws, table.columns, sample_out.suffix)
        if plot is not None:
            files[plot] = _plot(model, table, f"KDE of {data.name} (n = {len(x):,})", quiet)
    outputs.publish(files)

    summary = {
        "data": str(data),
        "points": len(x),
        "dimensions": x.shape[1],
        "columns": table.columns,
        "rows_dropped": table.dropped,
        "scale": scale.value,
        "prune": prune.value,
        "bandwidth_rule": bandwidth,
        **_bandwidth_and_fit(model.fitted, mean_loglik, mean_loglik_points),
        "fit_seconds": round(fit_seconds, 3),
        "seconds": round(clock.seconds, 3),
        "outputs": {name: str(path) for name, path in {
            "log_density": out, "samples": sample_out, "plot": plot}.items() if path is not None},
    }
    print_summary(summary, json_output, quiet, _format)


def _parse_bandwidth(text: str):
    """A rule's name, a positive number, or an array of them (one per column)."""
    from scalegp import kde

    names = kde.BANDWIDTH_RULES + kde.CV_BANDWIDTHS
    if text in names:
        return text
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise CLIError(f"--bandwidth {text!r}: give a positive number, numbers per column "
                       f"separated by commas, or one of {', '.join(names)}") from None
    if not all(np.isfinite(v) and v > 0 for v in values):
        raise CLIError(f"--bandwidth {text!r}: bandwidths must be positive and finite")
    return values[0] if len(values) == 1 else np.asarray(values)


def _check_sample_options(sample: int, sample_out: Path | None) -> None:
    if sample and sample_out is None:
        raise CLIError("--sample needs --sample-out FILE (.npy or .csv) for the draws")
    if sample_out is not None and not sample:
        raise CLIError("--sample-out needs --sample N, the number of draws")


def _check_sample_memory(sample: int, dimensions: int, sample_out: Path | None) -> None:
    """Before the fit: the draws, with the bytes of their file and its copy, must fit in
    memory."""
    if not sample:
        return
    from scalegp import kde

    # a .npy value takes 8 bytes; a CSV one up to 25 characters ("%.17g" and a comma)
    per_value = 8 if sample_out.suffix.lower() == ".npy" else 25
    try:
        kde.check_sample_memory(sample, dimensions, extra=2 * per_value * sample * dimensions)
    except MemoryError as error:
        raise CLIError(f"--sample {sample}: {error}") from None


def _read_points(data: Path, query: Path | None, **read) -> tuple[Table, Table | None]:
    """The data and the optional query points, which must have as many columns."""
    table = read_table(data, **read)
    queries = read_table(query, what="query", **read) if query is not None else None
    if queries is not None and queries.values.shape[1] != table.values.shape[1]:
        raise CLIError(f"--query {query} has {queries.values.shape[1]} columns, the data "
                       f"{table.values.shape[1]}; select the same columns with --columns")
    return table, queries


def _add_outputs(outputs: Outputs, out: Path | None, sample_out: Path | None, plot: Path | None,
                 dimensions: int) -> tuple[Path | None, Path | None, Path | None]:
    """Checks the destinations before any work; a plot also needs 1-D or 2-D data and
    matplotlib."""
    out = outputs.add(out)
    sample_out = outputs.add(sample_out, option="--sample-out")
    plot = outputs.add(plot, option="--plot", suffixes=(".png",))
    if plot is not None:
        from .plot import require_matplotlib

        require_matplotlib(dimensions)
    return out, sample_out, plot


class _Model:
    """The KDE the command fits: `scalegp.kde.fit_kde` and its `FittedKDE`, with the data and
    queries in ``dtype`` and the cross-validation's seed drawn from ``seed`` as
    `scalegp.ScalableKernelDensity` draws it from ``random_state`` (the same bandwidth and
    draws). Not the estimator itself: scikit-learn's import would be most of a run whose
    programs come from the compilation cache (docs/decisions.md #33)."""

    def __init__(self, bandwidth, scale: Scale, seed: int, prune, prune_tol, dtype):
        self.bandwidth, self.seed, self.dtype = bandwidth, seed, dtype
        self.scale = None if scale is Scale.none else scale.value
        self.prune, self.prune_tol = prune, prune_tol
        self.fitted = None

    def fit(self, x: np.ndarray) -> None:
        from scalegp import kde

        cv_seed = None
        if isinstance(self.bandwidth, str) and self.bandwidth in kde.CV_BANDWIDTHS:
            cv_seed = np.random.RandomState(self.seed).randint(np.iinfo(np.int32).max)
        self.fitted = kde.fit_kde(x.astype(self.dtype), bandwidth=self.bandwidth,
                                  scale=self.scale, random_state=cv_seed, prune=self.prune,
                                  prune_tol=self.prune_tol)

    def log_density(self, points: np.ndarray) -> np.ndarray:
        values = self.fitted.log_density(points.astype(self.dtype), prune=self.prune,
                                         prune_tol=self.prune_tol)
        return np.asarray(values, np.float64)


def _fit(model: _Model, x: np.ndarray, bandwidth: str, quiet: bool) -> float:
    """Fits ``model``; returns the seconds the fit took."""
    clock = Stopwatch()
    with status(f"fitting a KDE to {len(x):,} points (bandwidth {bandwidth})", quiet):
        model.fit(x)
    return clock.seconds


def _mean_log_likelihood(model: _Model, x: np.ndarray, seed: int, quiet: bool) -> tuple[float, int]:
    """The mean log-density of the data and the number of points it averages: all of them, or
    a random SUMMARY_POINTS when there are more."""
    if len(x) > SUMMARY_POINTS:
        x = x[np.random.default_rng(seed).choice(len(x), SUMMARY_POINTS, replace=False)]
    with status("scoring the data", quiet):
        return float(np.mean(model.log_density(x))), len(x)


def _plot(model: _Model, table: Table, title: str, quiet: bool) -> bytes:
    """The density with the data points, as PNG bytes."""
    from .plot import density_png

    with status("plotting", quiet):
        return density_png(table.values, table.columns,
                           model.log_density, title)


def _bandwidth_and_fit(fitted, mean_loglik: float, mean_loglik_points: int) -> dict:
    """The fitted bandwidth, the in-sample and (for a cross-validated bandwidth) leave-one-out
    mean log-likelihoods."""
    cv = fitted.cv_result
    return {
        "bandwidth": np.asarray(fitted.bandwidth, np.float64).tolist(),
        "mean_log_likelihood": mean_loglik,
        "mean_log_likelihood_points": mean_loglik_points,
        "loo_mean_log_likelihood": None if cv is None else
        float(cv.log_likelihood) + float(fitted.scaling.log_abs_det),
        "cv_converged": None if cv is None else bool(cv.converged),
    }


def _listed(items: list[str], most: int = 8) -> str:
    """``items`` joined by commas; a long list (wide data) as its first and last few."""
    if len(items) <= most:
        return ", ".join(items)
    return ", ".join(items[: most - 2]) + ", ..., " + ", ".join(items[-2:])


def _format(s: dict) -> str:
    bandwidth = s["bandwidth"]
    shown = (f"{bandwidth:.4g}" if isinstance(bandwidth, float)
             else "[" + _listed([f"{b:.4g}" for b in bandwidth]) + "]")
    units = "" if s["scale"] == "none" else f" (in {s['scale']}d units)"
    lines = [
        f"data:          {s['data']}  ({s['points']:,} points x {s['dimensions']} dimensions: "
        f"{_listed(s['columns'])})",
    ]
    if s["rows_dropped"]:
        lines.append(f"dropped:       {s['rows_dropped']} rows with missing values")
    lines.append(f"bandwidth:     {shown}{units}, by {s['bandwidth_rule']}")
    subset = ("" if s["mean_log_likelihood_points"] == s["points"]
              else f" (on {s['mean_log_likelihood_points']:,} random points)")
    lines.append(f"mean log-likelihood of the data: {s['mean_log_likelihood']:.4f}{subset}")
    if s["loo_mean_log_likelihood"] is not None:
        flag = "" if s["cv_converged"] else "  (cross-validation did not converge)"
        lines.append(f"leave-one-out mean log-likelihood: {s['loo_mean_log_likelihood']:.4f}"
                     f"{flag}")
    for name, path in s["outputs"].items():
        lines.append(f"wrote {name}: {path}")
    lines.append(f"time:          {s['seconds']:.2f} s (fit {s['fit_seconds']:.2f} s)")
    return "\n".join(lines)
