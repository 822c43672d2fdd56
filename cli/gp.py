"""`scalegp gp fit` and `scalegp gp predict`: exact GP regression on files, with safe model
files (:mod:`scalegp.persistence`, never pickle)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from .common import CLIError, Debug, Force, Json, Quiet, Stopwatch, parse_columns, \
    print_summary, reports_errors, shows_progress, status
from .io import Outputs, apply_missing_policy, encode_table, read_table

app = typer.Typer(help="Gaussian-process regression: fit a model, predict with it.",
                  no_args_is_help=True, add_completion=False)

SOLVERS = ("auto", "exact", "bbmm")
#: A secret here signs the model files that `gp fit` writes and is required by `gp predict`.
MODEL_KEY_ENV = "SCALEGP_MODEL_KEY"

FIT_EXAMPLES = """

Examples:

  scalegp gp fit examples/data/co2_weekly.csv --target co2 --test-size 0.2 --model co2.npz

  scalegp gp fit X.npy --y y.npy --float64 --max-iter 100 --model gp.npz

  scalegp gp fit big.csv --target y --subset-size 4096 --max-iter-full 5 --json
"""

PREDICT_EXAMPLES = """

Examples:

  scalegp gp predict co2.npz examples/data/co2_weekly.csv --std --out co2_pred.csv

  scalegp gp predict gp.npz X_new.npy --out mean.npy
"""

DataPath = Annotated[Path, typer.Argument(help="Feature table: .npy, .npz or .csv (with a "
                                                "header).", show_default=False)]
Key = Annotated[Optional[str], typer.Option(help="Array name inside an .npz file.")]
Delimiter = Annotated[Optional[str], typer.Option(
    help="CSV delimiter (default: guessed from the header line; 'tab' for tabs).")]
Missing = Annotated[str, typer.Option(help="Rows with missing values: 'error' or 'drop'.")]


def _enable_float64(float64: bool):
    if float64:
        import jax

        jax.config.update("jax_enable_x64", True)
    return "float64" if float64 else "float32"


def _split(n: int, test_size: float, seed: int):
    if not 0 <= test_size < 1:
        raise CLIError(f"--test-size must be in [0, 1), got {test_size}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = int(round(test_size * n))
    if test_size > 0 and not 1 <= n_test <= n - 2:
        raise CLIError(f"--test-size {test_size} leaves {n_test} test and {n - n_test} training "
                       f"points of {n}; choose a size that keeps both non-empty")
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def _gaussian_nll(y, mean, std) -> float:
    """Mean negative log predictive density per point (noise included in std)."""
    return float(np.mean(0.5 * np.log(2 * math.pi * std**2) + 0.5 * ((y - mean) / std) ** 2))


@reports_errors
def fit(
    data: DataPath,
    target: Annotated[Optional[str], typer.Option(
        help="Target column of DATA (name or index); the features are the other columns.")] = None,
    y: Annotated[Optional[Path], typer.Option(
        "--y", help="Targets from a separate file (one column) instead of --target.")] = None,
    features: Annotated[Optional[str], typer.Option(
        help="Feature columns, comma-separated (default: all but the target).")] = None,
    standardize: Annotated[bool, typer.Option(
        help="Standardise the features (StandardScaler in front of the GP, saved with it).")
    ] = True,
    normalize_y: Annotated[bool, typer.Option(help="Standardise the targets before fitting.")
                           ] = True,
    float64: Annotated[bool, typer.Option(help="Compute in float64 (default float32).")] = False,
    lengthscale: Annotated[float, typer.Option(
        help="Initial lengthscale (in standardised units with --standardize).", min=0)] = 1.0,
    noise: Annotated[float, typer.Option(
        help="Initial noise variance (in standardised target units with --normalize-y).", min=0)
    ] = 0.1,
    restarts: Annotated[int, typer.Option(
        help="Extra optimiser runs from random starts; the best likelihood wins.", min=0)] = 0,
    solver: Annotated[str, typer.Option(
        help="exact (Cholesky), bbmm (conjugate gradients, memory linear in n) or auto "
             "(exact up to 4,096 points).")] = "auto",
    max_iter: Annotated[int, typer.Option(
        help="L-BFGS-B iterations for the hyperparameters (on the subset for bbmm).", min=0)] = 200,
    subset_size: Annotated[int, typer.Option(
        help="bbmm: hyperparameters first on a random subset of this size.", min=2)] = 2048,
    max_iter_full: Annotated[int, typer.Option(
        help="bbmm: then this many iterations on all the data (0 skips).", min=0)] = 10,
    cg_tol: Annotated[float, typer.Option(help="bbmm: conjugate-gradient tolerance.")] = 1e-3,
    test_size: Annotated[float, typer.Option(
        help="Hold out this fraction (random) and report its RMSE and NLL.")] = 0.0,
    seed: Annotated[int, typer.Option(help="Seed for the split, subsets and probes.")] = 0,
    model: Annotated[Optional[Path], typer.Option(
        help="Save the fitted model here (.npz; a safe format, no pickle). Signed when "
             f"{MODEL_KEY_ENV} is set.")] = None,
    store_variance_cache: Annotated[bool, typer.Option(
        "--store-variance-cache", help="Also store the variance factor in the model file (n x n "
        "floats for the exact solver) instead of rebuilding it on the first --std.")] = False,
    key: Key = None,
    y_key: Annotated[Optional[str], typer.Option(help="Array name inside an .npz --y file.")
                     ] = None,
    delimiter: Delimiter = None,
    missing: Missing = "error",
    json_output: Json = False,
    force: Force = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Fit a Gaussian process (RBF kernel, constant mean, Gaussian noise) to a table."""
    clock = Stopwatch()
    if (target is None) == (y is None):
        raise CLIError("give the targets with exactly one of --target COLUMN or --y FILE")
    if solver not in SOLVERS:
        raise CLIError(f"--solver must be one of {', '.join(SOLVERS)}, got {solver!r}")
    if not (cg_tol > 0 and math.isfinite(cg_tol)):
        raise CLIError(f"--cg-tol must be a positive number, got {cg_tol}")
    outputs = Outputs(force=force, inputs=[data] + ([y] if y is not None else []))
    model = outputs.add(model, option="--model", suffixes=(".npz",))
    read = dict(key=key, delimiter=delimiter)
    feature_names = parse_columns(features, "--features")

    if target is not None:
        # Parse only the columns used, so that e.g. a text id column may stay in the file.
        wanted = None if feature_names is None else feature_names + [target]
        table = read_table(data, **read, columns=wanted, missing=None,
                           columns_option="--features")
        target_name = table.column_subset([target]).columns[0]
        names = feature_names or [c for c in table.columns if c != target_name]
        if target_name in table.column_subset(names).columns:
            raise CLIError(f"column {target_name!r} is both the target and a feature")
        if not names:
            raise CLIError(f"{data} has only the target column {target_name!r}; no features")
        table = apply_missing_policy(table.column_subset(names + [target_name]), missing)
        x, targets = table.values[:, :-1], table.values[:, -1]
        names, target_name = table.columns[:-1], table.columns[-1]
    else:
        table = read_table(data, **read, columns=feature_names, missing=missing,
                           columns_option="--features")
        y_table = read_table(y, what="target", key=y_key, delimiter=delimiter, missing="error")
        if y_table.values.shape[1] != 1:
            raise CLIError(f"--y {y} has {y_table.values.shape[1]} columns; give one column of "
                           "targets")
        if len(y_table.values) != len(table.values) + table.dropped:
            raise CLIError(f"--y {y} has {len(y_table.values)} rows, {data} has "
                           f"{len(table.values) + table.dropped}; they must match row for row")
        if table.dropped:
            raise CLIError(f"{data} has rows with missing values; with --y they cannot be dropped "
                           "consistently: clean the files or use --target")
        x, targets = table.values, y_table.values[:, 0]
        names, target_name = table.columns, y_table.columns[0] if y_table.columns != ["0"] else "y"

    train, test = _split(len(x), test_size, seed)
    dtype = _enable_float64(float64)
    estimator = _make_model(standardize, lengthscale=lengthscale, noise=noise,
                            n_restarts_optimizer=restarts, normalize_y=normalize_y, dtype=dtype,
                            solver=solver, max_iter=max_iter, subset_size=subset_size,
                            max_iter_full=max_iter_full, cg_tol=cg_tol, random_state=seed)
    gp = estimator[-1]
    # On a terminal with tqdm (the progress extra) the estimator draws a bar per optimiser
    # phase; otherwise a spinner with the elapsed time stands in.
    if shows_progress(quiet) and importlib.util.find_spec("tqdm") is not None:
        gp.set_params(verbose=1)
        fitting = contextlib.nullcontext()
    else:
        fitting = status(f"fitting a GP to {len(train):,} points x {x.shape[1]} features", quiet)
    fit_clock = Stopwatch()
    with fitting:
        estimator.fit(x[train], targets[train])
    fit_seconds = fit_clock.seconds

    summary = {
        "data": str(data),
        "train_points": int(len(train)),
        "test_points": int(len(test)),
        "features": names,
        "target": target_name,
        "rows_dropped": table.dropped,
        "solver": gp.solver_,
        "dtype": dtype,
        "lengthscale": gp.lengthscale_.tolist(),
        "lengthscale_units": "standardized features" if standardize else "features",
        "outputscale": gp.outputscale_,
        "noise": gp.noise_,
        "mean": np.asarray(gp.mean_).tolist(),
        "target_units": "standardized target" if normalize_y else "target",
        "log_marginal_likelihood": gp.log_marginal_likelihood_value_,
        "optimizer_iterations": gp.n_iter_,
        "fit_seconds": round(fit_seconds, 3),
    }
    if len(test):
        with status(f"predicting {len(test):,} held-out points", quiet):
            mean, std = estimator.predict(x[test], return_std=True)
        residual = targets[test] - mean
        summary.update({
            "test_rmse": float(np.sqrt(np.mean(residual**2))),
            "test_nll": _gaussian_nll(targets[test], mean, std),
            "test_rmse_of_train_mean": float(np.sqrt(np.mean(
                (targets[test] - targets[train].mean()) ** 2))),
        })
    if model is not None:
        from scalegp.persistence import save_model

        named = _has_column_names(data)  # without, predict takes columns by position
        metadata = {"features": names if named else None, "target": target_name,
                    "dtype": summary["dtype"]}
        outputs.publish({model: lambda path: save_model(
            estimator, path, key=_model_key(), store_variance_cache=store_variance_cache,
            metadata=metadata)})
        summary["model"] = str(model)
    summary["seconds"] = round(clock.seconds, 3)
    print_summary(summary, json_output, quiet, _format_fit)


def _has_column_names(path: Path) -> bool:
    """A CSV's header names its columns; an array's columns are numbered only."""
    return path.suffix.lower() not in (".npy", ".npz")


def _model_key() -> str | None:
    key = os.environ.get(MODEL_KEY_ENV)
    if key == "":
        raise CLIError(f"{MODEL_KEY_ENV} is set but empty; set it to a secret key, or unset it")
    return key


def _make_model(standardize: bool, **settings):
    """StandardScaler (optional) then the GP, as one Pipeline: saved and loaded together."""
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from scalegp import ScalableGPRegressor

    gp = ScalableGPRegressor(**settings)
    steps = ([("scale", StandardScaler())] if standardize else []) + [("gp", gp)]
    return Pipeline(steps)


def _format_fit(s: dict) -> str:
    def numbers(values):
        values = values if isinstance(values, list) else [values]
        return ", ".join(f"{v:.4g}" for v in values)

    lines = [
        f"data:        {s['data']}  ({s['train_points']:,} training"
        + (f", {s['test_points']:,} held-out" if s["test_points"] else "") + " points)",
        f"features:    {', '.join(s['features'])}  ->  target: {s['target']}",
    ]
    if s["rows_dropped"]:
        lines.append(f"dropped:     {s['rows_dropped']} rows with missing values")
    lines += [
        f"solver:      {s['solver']} ({s['dtype']}), {s['optimizer_iterations']} optimiser "
        "iterations",
        f"lengthscale: {numbers(s['lengthscale'])}  (in {s['lengthscale_units']})",
        f"outputscale: {numbers(s['outputscale'])}, noise variance: {numbers(s['noise'])}  "
        f"(in {s['target_units']} units)",
        f"mean:        {numbers(s['mean'])}  (in target units)",
        f"log marginal likelihood: {s['log_marginal_likelihood']:.6g}",
    ]
    if "test_rmse" in s:
        lines.append(f"held-out RMSE: {s['test_rmse']:.6g}  (predicting the training mean: "
                     f"{s['test_rmse_of_train_mean']:.6g});  NLL per point: {s['test_nll']:.4f}")
    if "model" in s:
        lines.append(f"wrote model: {s['model']}")
    lines.append(f"time:        {s['seconds']:.2f} s (fit {s['fit_seconds']:.2f} s)")
    return "\n".join(lines)


@reports_errors
def predict(
    model: Annotated[Path, typer.Argument(help="A model saved by 'scalegp gp fit --model'.",
                                          show_default=False)],
    data: DataPath,
    out: Annotated[Optional[Path], typer.Option(
        help="Write predictions here (.npy or .csv): the mean, and with --std a second column.")
    ] = None,
    std: Annotated[bool, typer.Option("--std", help="Also the predictive standard deviation of "
                                                     "y (noise included).")] = False,
    columns: Annotated[Optional[str], typer.Option(
        help="Feature columns of DATA, comma-separated (default: the model's feature names; all "
             "columns for an array).")] = None,
    by_position: Annotated[bool, typer.Option(
        "--by-position", help="Use the columns of a CSV in order even when their names differ "
                              "from the model's features.")] = False,
    key: Key = None,
    delimiter: Delimiter = None,
    missing: Missing = "error",
    json_output: Json = False,
    force: Force = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Predict with a saved GP model."""
    clock = Stopwatch()
    from scalegp.persistence import load_model

    if not model.is_file():
        raise CLIError(f"model file {str(model)!r} does not exist or is not a file")
    outputs = Outputs(force=force, inputs=[model, data])
    out = outputs.add(out)
    estimator, metadata = load_model(model, return_metadata=True, key=_model_key())
    if not hasattr(estimator, "predict"):
        raise CLIError(f"{model} holds a fitted {type(estimator).__name__} without a regressor: "
                       "this model cannot predict; give a model from 'scalegp gp fit --model'")
    trained_on = metadata.get("features")
    if trained_on is not None and not (
            isinstance(trained_on, list) and all(isinstance(c, str) for c in trained_on)
            and len(trained_on) == estimator.n_features_in_):
        raise CLIError(f"{model}: its feature names ({str(trained_on)[:80]}) are not "
                       f"{estimator.n_features_in_} strings; the file is damaged")
    # Parse only the chosen columns, so that e.g. a text id column may stay in the file.
    chosen = parse_columns(columns)
    table = read_table(data, key=key, delimiter=delimiter, columns=chosen, missing=None)
    if chosen is None and trained_on and _has_column_names(data) and not by_position:
        absent = [c for c in trained_on if c not in table.columns]
        if absent:  # as scikit-learn: names that differ are an error, not a positional match
            raise CLIError(f"{data} has no column {', '.join(map(repr, absent))}; the model was "
                           f"trained on {', '.join(trained_on)}. Rename the columns, choose "
                           "them with --columns, or pass --by-position to use them in order")
        table = table.column_subset(trained_on)  # the training columns, in any order
    table = apply_missing_policy(table, missing)
    expected = estimator.n_features_in_
    if table.values.shape[1] != expected:
        raise CLIError(f"{data} gives {table.values.shape[1]} feature columns, the model needs "
                       f"{expected} ({', '.join(trained_on or [])}); choose them with --columns")
    _enable_float64(metadata.get("dtype") == "float64")
    with status(f"predicting {len(table.values):,} points", quiet):
        result = estimator.predict(table.values, return_std=std)
    mean, spread = (result if std else (result, None))
    names = ["mean"] + (["std"] if std else [])
    values = np.column_stack([mean] + ([spread] if std else []))
    if out is not None:
        outputs.publish({out: encode_table(values if std else mean, names, out.suffix)})
    summary = {"model": str(model), "data": str(data), "points": int(len(mean)),
               "rows_dropped": table.dropped, "output": None if out is None else str(out),
               "seconds": round(clock.seconds, 3)}
    if out is None and not json_output:
        typer.echo(",".join(names))
        for row in values:
            typer.echo(",".join(f"{v:.9g}" for v in row))
        return
    print_summary(summary, json_output, quiet,
                  lambda s: f"predicted {s['points']:,} points with {s['model']}"
                  + (f"; wrote {s['output']}" if s["output"] else "")
                  + f" ({s['seconds']:.2f} s)")


fit.__doc__ += FIT_EXAMPLES
predict.__doc__ += PREDICT_EXAMPLES
app.command("fit")(fit)
app.command("predict")(predict)
