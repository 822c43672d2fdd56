"""`scalegp kde`: fit a Gaussian KDE to a file, summarise it, write densities, samples, a plot."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from .common import CLIError, Debug, Force, Json, Quiet, Stopwatch, parse_columns, \
    print_summary, reports_errors, status
from .io import Outputs, encode_table, read_table

SCALES = ("none", "standardize", "covariance")
#: Above this many points the summary's mean log-likelihood uses a random subset of this size
#: (scoring all n points costs n² kernel evaluations); `--out` always scores every point.
SUMMARY_POINTS = 20_000

EXAMPLES = """

Examples:

  scalegp kde examples/data/us_macro_quarterly.csv --columns unemp,infl --plot kde.png

  scalegp kde points.npy --bandwidth scott --out logp.npy

  scalegp kde train.csv --query test.csv --out test_logp.csv --json

  scalegp kde data.npz --key x --sample 1000 --sample-out draws.npy --seed 0
"""


def _parse_bandwidth(text: str):
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


def kde_command(
    data: Annotated[Path, typer.Argument(help="Points, one per row: .npy, .npz or .csv (with a "
                                               "header). A 1-D array is points on a line.",
                                         show_default=False)],
    bandwidth: Annotated[str, typer.Option(
        help="A number (or one per column, comma-separated), 'scott', 'silverman', 'cv' "
             "(leave-one-out cross-validation) or 'cv-diag' (one per column). 'cv' is the most "
             "accurate; the rules are instant.")] = "cv",
    scale: Annotated[str, typer.Option(
        help="Feature scaling before smoothing: none, standardize (per column) or covariance "
             "(full whitening, as scipy's gaussian_kde).")] = "standardize",
    columns: Annotated[Optional[str], typer.Option(
        help="Columns to use, by name or index, comma-separated (default: all).")] = None,
    key: Annotated[Optional[str], typer.Option(help="Array name inside an .npz file.")] = None,
    delimiter: Annotated[Optional[str], typer.Option(
        help="CSV delimiter (default: guessed from the header line; 'tab' for tabs).")] = None,
    missing: Annotated[str, typer.Option(
        help="Rows with missing values: 'error' or 'drop'.")] = "error",
    query: Annotated[Optional[Path], typer.Option(
        help="Score these points instead of the data (same columns, same format options).")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="Write log-densities of the data (or of --query) here: .npy or .csv.")] = None,
    sample: Annotated[int, typer.Option(help="Draw this many samples from the density.",
                                        min=0)] = 0,
    sample_out: Annotated[Optional[Path], typer.Option(
        help="Where --sample writes its draws: .npy or .csv.")] = None,
    seed: Annotated[int, typer.Option(help="Seed for cross-validation subsets and samples.")] = 0,
    plot: Annotated[Optional[Path], typer.Option(
        help="Draw the density with the points to this PNG (1-D or 2-D data; needs the plot "
             "extra).")] = None,
    json_output: Json = False,
    force: Force = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Fit a Gaussian kernel density estimate and report it."""
    clock = Stopwatch()
    from scalegp import ScalableKernelDensity

    if scale not in SCALES:
        raise CLIError(f"--scale must be one of {', '.join(SCALES)}, got {scale!r}")
    chosen_bandwidth = _parse_bandwidth(bandwidth)
    if sample and sample_out is None:
        raise CLIError("--sample needs --sample-out FILE (.npy or .csv) for the draws")
    if sample_out is not None and not sample:
        raise CLIError("--sample-out needs --sample N, the number of draws")
    read = dict(key=key, columns=parse_columns(columns), delimiter=delimiter, missing=missing)
    table = read_table(data, **read)
    queries = read_table(query, what="query", **read) if query is not None else None
    if queries is not None and queries.values.shape[1] != table.values.shape[1]:
        raise CLIError(f"--query {query} has {queries.values.shape[1]} columns, the data "
                       f"{table.values.shape[1]}; select the same columns with --columns")
    outputs = Outputs(force=force, inputs=[data] + ([query] if query is not None else []))
    out = outputs.add(out)
    sample_out = outputs.add(sample_out, option="--sample-out")
    plot = outputs.add(plot, option="--plot", suffixes=(".png",))
    if plot is not None:
        from .plot import require_matplotlib

        require_matplotlib(table.values.shape[1])

    x = table.values
    n, d = x.shape
    estimator = ScalableKernelDensity(
        bandwidth=chosen_bandwidth, scale=None if scale == "none" else scale, random_state=seed)
    fit_clock = Stopwatch()
    with status(f"fitting a KDE to {n:,} points (bandwidth {bandwidth})", quiet):
        estimator.fit(x)
    fit_seconds = fit_clock.seconds

    # Every result is computed before any file is written: they are published together.
    files = {}
    scored = queries.values if queries is not None else x
    if out is not None:
        with status(f"scoring {len(scored):,} points", quiet):
            log_density = np.asarray(estimator.score_samples(scored), np.float64)
        files[out] = encode_table(log_density, ["log_density"], out.suffix)
    summary_points = x
    if queries is None and out is not None:
        mean_loglik = float(np.mean(log_density))
    else:
        if n > SUMMARY_POINTS:
            rng = np.random.default_rng(seed)
            summary_points = x[rng.choice(n, SUMMARY_POINTS, replace=False)]
        with status("scoring the data", quiet):
            mean_loglik = float(np.mean(estimator.score_samples(summary_points)))
    if sample:
        draws = estimator.sample(sample, random_state=seed)
        files[sample_out] = encode_table(draws, table.columns, sample_out.suffix)
    if plot is not None:
        from .plot import density_png

        with status("plotting", quiet):
            files[plot] = density_png(
                x, table.columns,
                lambda points: np.asarray(estimator.score_samples(points), np.float64),
                f"KDE of {data.name} (n = {n:,})")
    outputs.publish(files)

    cv = estimator.cv_result_
    summary = {
        "data": str(data),
        "points": n,
        "dimensions": d,
        "columns": table.columns,
        "rows_dropped": table.dropped,
        "scale": scale,
        "bandwidth_rule": bandwidth,
        "bandwidth": np.asarray(estimator.bandwidth_, np.float64).tolist(),
        "mean_log_likelihood": mean_loglik,
        "mean_log_likelihood_points": len(summary_points) if summary_points is not x else n,
        "loo_mean_log_likelihood": None if cv is None else
        float(cv.log_likelihood) + float(estimator.scaling_.log_abs_det),
        "cv_converged": None if cv is None else bool(cv.converged),
        "fit_seconds": round(fit_seconds, 3),
        "seconds": round(clock.seconds, 3),
        "outputs": {name: str(p) for name, p in
                    zip(("log_density", "samples", "plot"), (out, sample_out, plot))
                    if p is not None},
    }
    print_summary(summary, json_output, quiet, _format)


def _format(s: dict) -> str:
    bandwidth = s["bandwidth"]
    shown = (f"{bandwidth:.4g}" if isinstance(bandwidth, float)
             else "[" + ", ".join(f"{b:.4g}" for b in bandwidth) + "]")
    units = "" if s["scale"] == "none" else f" (in {s['scale']}d units)"
    lines = [
        f"data:          {s['data']}  ({s['points']:,} points x {s['dimensions']} dimensions: "
        f"{', '.join(s['columns'])})",
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


kde_command.__doc__ += EXAMPLES
kde_command = reports_errors(kde_command)
