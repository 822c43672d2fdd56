"""`scalegp gp fit`, `scalegp gp predict` and `scalegp gp sample`: exact GP regression on
files, with safe model files (:mod:`scalegp.persistence`, never pickle)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from .common import CLIError, Choice, Debug, Delimiter, Force, Json, Key, Missing, Quiet, \
    Stopwatch, parse_columns, print_summary, reports_errors, shows_progress, status
from .io import Outputs, Table, apply_missing_policy, encode_table, read_table
from .kernel_spec import HELP as KERNEL_HELP
from .training import TrainingData, read_training_data, split_rows

#: A secret here signs the model files that `gp fit` writes and is required by `gp predict`.
MODEL_KEY_ENV = "SCALEGP_MODEL_KEY"

DataPath = Annotated[Path, typer.Argument(help="Feature table: .npy, .npz or .csv (with a "
                                                "header).", show_default=False)]


class Solver(Choice):
    auto = "auto"
    exact = "exact"
    bbmm = "bbmm"


# `gp fit`'s options (the shared ones are in .common)
TargetColumn = Annotated[Optional[str], typer.Option(
    help="Target column of DATA (name or index); the features are the other columns.")]
TargetFile = Annotated[Optional[Path], typer.Option(
    "--y", help="Targets from a separate file (one column) instead of --target.")]
FeatureColumns = Annotated[Optional[str], typer.Option(
    help="Feature columns, comma-separated (default: all but the target).")]
Standardize = Annotated[bool, typer.Option(
    help="Standardise the features (StandardScaler in front of the GP, saved with it).")]
NormalizeY = Annotated[bool, typer.Option(help="Standardise the targets before fitting.")]
ModelPath = Annotated[Path, typer.Argument(help="A model saved by 'scalegp gp fit --model'.",
                                           show_default=False)]
ModelColumns = Annotated[Optional[str], typer.Option(
    help="Feature columns of DATA, comma-separated (default: the model's feature names; all "
         "columns for an array).")]
ByPosition = Annotated[bool, typer.Option(
    "--by-position", help="Use the columns of a CSV in order even when their names differ from "
                          "the model's features.")]
Float64 = Annotated[bool, typer.Option(help="Compute in float64 (default float32).")]
Lengthscale = Annotated[Optional[float], typer.Option(
    help="Initial lengthscale of the default model (in standardised units with "
         "--standardize); default 1.0. With --kernel, give lengthscales in the formula.",
    min=0, show_default=False)]
Noise = Annotated[float, typer.Option(
    help="Initial noise variance (in standardised target units with --normalize-y).", min=0)]
KernelFormula = Annotated[Optional[str], typer.Option(help=KERNEL_HELP, show_default=False)]
Restarts = Annotated[int, typer.Option(
    help="Extra optimiser runs from random starts; the best likelihood wins.", min=0)]
SolverOption = Annotated[Solver, typer.Option(
    help="exact (Cholesky), bbmm (conjugate gradients, memory linear in n) or auto "
         "(exact up to 4,096 points).", parser=Solver.parser("--solver"))]
MaxIter = Annotated[int, typer.Option(
    help="L-BFGS-B iterations for the hyperparameters (on the subset for bbmm).", min=0)]
SubsetSize = Annotated[int, typer.Option(
    help="bbmm: hyperparameters first on a random subset of this size.", min=2)]
MaxIterFull = Annotated[int, typer.Option(
    help="bbmm: then at most this many scoring steps per stage, on growing subsets and "
         "last on all the data (0 skips).", min=0)]
CgTol = Annotated[float, typer.Option(help="bbmm: conjugate-gradient tolerance.")]
TestSize = Annotated[float, typer.Option(
    help="Hold out this fraction (random) and report its RMSE and NLL.")]
Seed = Annotated[int, typer.Option(help="Seed for the split, subsets and probes.")]
ModelFile = Annotated[Optional[Path], typer.Option(
    help="Save the fitted model here (.npz; a safe format, no pickle). Signed when "
         f"{MODEL_KEY_ENV} is set (a secret of UTF-8 text).")]
StoreVarianceCache = Annotated[bool, typer.Option(
    "--store-variance-cache", help="Also store the variance factor in the model file (n x n "
    "floats for the exact solver) instead of rebuilding it on the first --std.")]
PlotFile = Annotated[Optional[Path], typer.Option(
    help="Draw the data, the fitted mean and its 95% band (noise included) to this PNG; "
         "held-out points in another colour. One-feature data; needs the plot extra.")]
YKey = Annotated[Optional[str], typer.Option(help="Array name inside an .npz --y file.")]


@reports_errors
def fit(
    data: DataPath,
    target: TargetColumn = None,
    y: TargetFile = None,
    features: FeatureColumns = None,
    standardize: Standardize = True,
    normalize_y: NormalizeY = True,
    float64: Float64 = False,
    lengthscale: Lengthscale = None,
    noise: Noise = 0.1,
    kernel: KernelFormula = None,
    restarts: Restarts = 0,
    solver: SolverOption = Solver.auto,
    max_iter: MaxIter = 200,
    subset_size: SubsetSize = 2048,
    max_iter_full: MaxIterFull = 10,
    cg_tol: CgTol = 1e-3,
    test_size: TestSize = 0.0,
    seed: Seed = 0,
    model: ModelFile = None,
    store_variance_cache: StoreVarianceCache = False,
    plot: PlotFile = None,
    key: Key = None,
    y_key: YKey = None,
    delimiter: Delimiter = None,
    missing: Missing = "error",
    json_output: Json = False,
    force: Force = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Fit a Gaussian process (RBF kernel or --kernel, constant mean, Gaussian noise) to a table.

    Examples:

      scalegp gp fit examples/data/co2_weekly.csv --target co2 --test-size 0.2 --model co2.npz

      scalegp gp fit examples/data/co2_weekly.csv --target co2 --no-standardize --kernel
      "rbf(lengthscale=50) + rbf(lengthscale=100)*periodic(period=1) + rq" --plot co2.png

      scalegp gp fit X.npy --y y.npy --float64 --max-iter 100 --model gp.npz

      scalegp gp fit big.csv --target y --subset-size 4096 --max-iter-full 5 --json
    """
    clock = Stopwatch()
    _check_fit_options(target, y, cg_tol)
    kernel_object = _parse_kernel_option(kernel, lengthscale, noise)
    outputs = Outputs(force=force, inputs=[data] + ([y] if y is not None else []))
    model = outputs.add(model, option="--model", suffixes=(".npz",))
    plot = outputs.add(plot, option="--plot", suffixes=(".png",))
    signing_key = _model_key() if model is not None else None  # checked before the fit
    training = read_training_data(data, target, y, features=parse_columns(features, "--features"),
                                  key=key, y_key=y_key, delimiter=delimiter, missing=missing)
    if plot is not None:
        _check_plot(training)
    train, test = split_rows(len(training.x), test_size, seed)
    dtype = "float64" if float64 else "float32"  # the estimator scopes x64 itself
    estimator = _make_model(standardize, kernel_object,
                            lengthscale=1.0 if lengthscale is None else lengthscale, noise=noise,
                            n_restarts_optimizer=restarts, normalize_y=normalize_y, dtype=dtype,
                            solver=solver.value, max_iter=max_iter, subset_size=subset_size,
                            max_iter_full=max_iter_full, cg_tol=cg_tol, random_state=seed)
    fit_seconds = _fit_with_progress(estimator, training.x[train], training.y[train], quiet)
    summary = {"data": str(data), "train_points": len(train), "test_points": len(test),
               "features": training.features, "target": training.target,
               "rows_dropped": training.dropped,
               **_hyperparameters(estimator[-1], dtype, standardize, normalize_y,
                                  kernel is not None),
               "fit_seconds": round(fit_seconds, 3)}
    if len(test):
        summary.update(_held_out_errors(estimator, training, train, test, quiet))
    # Every file is made before any is written: they are published together.
    files = {}
    if plot is not None:
        files[plot] = _plot(estimator, training, train, test, data, quiet)
        summary["plot"] = str(plot)
    if model is not None:
        files[model] = _model_writer(estimator, data, training, dtype, signing_key,
                                     store_variance_cache)
        summary["model"] = str(model)
    outputs.publish(files)
    summary["seconds"] = round(clock.seconds, 3)
    print_summary(summary, json_output, quiet, _format_fit)


def _check_fit_options(target: str | None, y: Path | None, cg_tol: float) -> None:
    if (target is None) == (y is None):
        raise CLIError("give the targets with exactly one of --target COLUMN or --y FILE")
    if not (cg_tol > 0 and math.isfinite(cg_tol)):
        raise CLIError(f"--cg-tol must be a positive number, got {cg_tol}")


def _parse_kernel_option(text: str | None, lengthscale: float | None, noise: float):
    """--kernel as a scikit-learn kernel (None without it), checked before any work."""
    if text is None:
        return None
    if lengthscale is not None:  # refused rather than ignored: the user expects it to count
        raise CLIError("--lengthscale sets the default model's lengthscale; with --kernel give "
                       "lengthscales in the formula, e.g. --kernel 'rbf(lengthscale=2)'")
    from .kernel_spec import parse_kernel

    return parse_kernel(text, noise=noise)


def _check_plot(training: TrainingData) -> None:
    """Before any fitting: one feature to draw against, and matplotlib."""
    from .plot import require_matplotlib

    n_features = training.x.shape[1]
    if n_features != 1:
        raise CLIError(f"--plot draws one-feature data; this data has {n_features} features "
                       f"({_shorten_list(training.features)}): choose one with --features")
    require_matplotlib()


def _shorten_list(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit
                                       else "")


def _make_model(standardize: bool, kernel, **settings):
    """StandardScaler (optional) then the GP, as one Pipeline: saved and loaded together."""
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    from scalegp import ScalableGPRegressor

    # kernel= only when asked: a scalegp without the parameter still fits the default model.
    chosen = {} if kernel is None else {"kernel": kernel}
    gp = ScalableGPRegressor(**chosen, **settings)
    steps = ([("scale", StandardScaler())] if standardize else []) + [("gp", gp)]
    return Pipeline(steps)


def _fit_with_progress(estimator, x: np.ndarray, y: np.ndarray, quiet: bool) -> float:
    """Fits ``estimator``; returns the seconds the fit took."""
    # On a terminal the estimator reports its phases on stderr, each with its elapsed time and
    # an estimate of what remains: a bar per optimiser phase with tqdm (the progress extra),
    # lines without it. No spinner here: its live line would garble those.
    if shows_progress(quiet):
        typer.echo(f"fitting a GP to {len(x):,} points x {x.shape[1]} features", err=True)
        estimator[-1].set_params(verbose=1)
    clock = Stopwatch()
    estimator.fit(x, y)
    return clock.seconds


def _hyperparameters(gp, dtype: str, standardize: bool, normalize_y: bool,
                     kernel_given: bool) -> dict:
    """The fitted GP's hyperparameters and optimiser result, with the units they are in."""
    if kernel_given:  # a formula's parameters: scikit-learn's text names them all
        parameters = {"kernel": str(gp.kernel_)}
    else:
        parameters = {"lengthscale": gp.lengthscale_.tolist(), "outputscale": gp.outputscale_,
                      "noise": gp.noise_}
    return {
        "solver": gp.solver_,
        "dtype": dtype,
        **parameters,
        "lengthscale_units": "standardized features" if standardize else "features",
        "mean": np.asarray(gp.mean_).tolist(),
        "target_units": "standardized target" if normalize_y else "target",
        "log_marginal_likelihood": gp.log_marginal_likelihood_value_,
        "optimizer_iterations": gp.n_iter_,
    }


def _held_out_errors(estimator, training: TrainingData, train: np.ndarray, test: np.ndarray,
                     quiet: bool) -> dict:
    """RMSE and NLL on the held-out points, and the RMSE of predicting the training mean."""
    with status(f"predicting {len(test):,} held-out points", quiet):
        mean, std = estimator.predict(training.x[test], return_std=True)
    truth = training.y[test]
    return {
        "test_rmse": _rmse(truth - mean),
        "test_nll": _gaussian_nll(truth, mean, std),
        "test_rmse_of_train_mean": _rmse(truth - training.y[train].mean()),
    }


def _rmse(residual: np.ndarray) -> float:
    return float(np.sqrt(np.mean(residual**2)))


def _gaussian_nll(y, mean, std) -> float:
    """Mean negative log predictive density per point (noise included in std)."""
    return float(np.mean(0.5 * np.log(2 * math.pi * std**2) + 0.5 * ((y - mean) / std) ** 2))


def _plot(estimator, training: TrainingData, train: np.ndarray, test: np.ndarray, data: Path,
          quiet: bool) -> bytes:
    """The data, the fitted mean and its 95% band over the one feature, as PNG bytes."""
    from .plot import regression_png

    def predict(grid: np.ndarray):
        mean, std = estimator.predict(grid[:, None], return_std=True)
        return np.asarray(mean, np.float64), np.asarray(std, np.float64)

    x, y = training.x[:, 0], training.y
    with status("plotting", quiet):
        return regression_png((x[train], y[train]), (x[test], y[test]), predict,
                              training.features[0], training.target,
                              f"GP fit to {data.name} (n = {len(train):,})")


def _model_writer(estimator, data: Path, training: TrainingData, dtype: str, key: str | None,
                  store_variance_cache: bool):
    """Writes the model file where it is told, with what `gp predict` needs to know of the
    training data."""
    from scalegp.persistence import save_model

    named = _has_column_names(data)  # without, predict takes columns by position
    metadata = {"features": training.features if named else None, "target": training.target,
                "dtype": dtype}
    return lambda temporary: save_model(estimator, temporary, key=key,
                                        store_variance_cache=store_variance_cache,
                                        metadata=metadata)


def _has_column_names(path: Path) -> bool:
    """A CSV's header names its columns; an array's columns are numbered only."""
    return path.suffix.lower() not in (".npy", ".npz")


def _model_key() -> str | None:
    """The key in ``SCALEGP_MODEL_KEY`` (None when unset), checked before any work: non-empty
    UTF-8 text, whose UTF-8 bytes sign and verify, as ``save_model(..., key=text)`` does."""
    if os.supports_bytes_environ:  # POSIX: the bytes as set, whatever the locale
        raw = os.environb.get(os.fsencode(MODEL_KEY_ENV))
    else:  # Windows: text already, which a lone surrogate keeps from being UTF-8
        text = os.environ.get(MODEL_KEY_ENV)
        raw = None if text is None else text.encode("utf-8", "surrogatepass")
    if raw is None:
        return None
    if not raw:
        raise CLIError(f"{MODEL_KEY_ENV} is set but empty; set it to a secret key, or unset it")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise CLIError(f"{MODEL_KEY_ENV} is not UTF-8 text (byte {raw[error.start]:#04x} at "
                       f"position {error.start}); set it to a secret of UTF-8 characters, e.g. "
                       "the output of: openssl rand -hex 32") from None


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
    ]
    if "kernel" in s:
        lines.append(f"kernel:      {s['kernel']}  (lengthscales in {s['lengthscale_units']}, "
                     f"variances in {s['target_units']} units)")
    else:
        lines += [
            f"lengthscale: {numbers(s['lengthscale'])}  (in {s['lengthscale_units']})",
            f"outputscale: {numbers(s['outputscale'])}, noise variance: {numbers(s['noise'])}  "
            f"(in {s['target_units']} units)",
        ]
    lines += [
        f"mean:        {numbers(s['mean'])}  (in target units)",
        f"log marginal likelihood: {s['log_marginal_likelihood']:.6g}",
    ]
    if "test_rmse" in s:
        lines.append(f"held-out RMSE: {s['test_rmse']:.6g}  (predicting the training mean: "
                     f"{s['test_rmse_of_train_mean']:.6g});  NLL per point: {s['test_nll']:.4f}")
    if "plot" in s:
        lines.append(f"wrote plot:  {s['plot']}")
    if "model" in s:
        lines.append(f"wrote model: {s['model']}")
    lines.append(f"time:        {s['seconds']:.2f} s (fit {s['fit_seconds']:.2f} s)")
    return "\n".join(lines)


@reports_errors
def predict(
    model: ModelPath,
    data: DataPath,
    out: Annotated[Optional[Path], typer.Option(
        help="Write predictions here (.npy or .csv): the mean, and with --std a second column.")
    ] = None,
    std: Annotated[bool, typer.Option("--std", help="Also the predictive standard deviation of "
                                                     "y (noise included).")] = False,
    columns: ModelColumns = None,
    by_position: ByPosition = False,
    key: Key = None,
    delimiter: Delimiter = None,
    missing: Missing = "error",
    json_output: Json = False,
    force: Force = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Predict with a saved GP model.

    Examples:

      scalegp gp predict co2.npz examples/data/co2_weekly.csv --std --out co2_pred.csv

      scalegp gp predict gp.npz X_new.npy --out mean.npy
    """
    clock = Stopwatch()
    outputs = Outputs(force=force, inputs=[model, data])
    out = outputs.add(out)
    estimator, table = _open_model(model, data, columns, by_position, key=key,
                                   delimiter=delimiter, missing=missing)
    with status(f"predicting {len(table.values):,} points", quiet):
        result = estimator.predict(table.values, return_std=std)
    mean, spread = (result if std else (result, None))
    names = ["mean"] + (["std"] if std else [])
    values = np.column_stack([mean] + ([spread] if std else []))
    if out is not None:
        outputs.publish({out: encode_table(values if std else mean, names, out.suffix)})
    if out is None and not json_output:
        _print_predictions(names, values)
        return
    summary = {"model": str(model), "data": str(data), "points": len(mean),
               "rows_dropped": table.dropped, "output": None if out is None else str(out),
               "seconds": round(clock.seconds, 3)}
    print_summary(summary, json_output, quiet, _format_predict)


@reports_errors
def sample(
    model: ModelPath,
    data: DataPath,
    n: Annotated[int, typer.Option("--n", help="Samples to draw.", min=1)] = 10,
    out: Annotated[Optional[Path], typer.Option(
        help="Write the samples here (.npy or .csv): one column per sample.")] = None,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives the same samples.")] = 0,
    columns: ModelColumns = None,
    by_position: ByPosition = False,
    key: Key = None,
    delimiter: Delimiter = None,
    missing: Missing = "error",
    json_output: Json = False,
    force: Force = False,
    quiet: Quiet = False,
    debug: Debug = False,
):
    """Draw samples of y (noise included) from a saved GP model's posterior at new points:
    joint over DATA's rows, exact up to 1,000 rows, pathwise beyond (memory linear in the rows).

    Examples:

      scalegp gp sample co2.npz examples/data/co2_weekly.csv --n 10 --out co2_samples.csv

      scalegp gp sample gp.npz X_new.npy --n 100 --seed 1 --out samples.npy
    """
    clock = Stopwatch()
    outputs = Outputs(force=force, inputs=[model, data])
    out = outputs.add(out)
    estimator, table = _open_model(model, data, columns, by_position, key=key,
                                   delimiter=delimiter, missing=missing)
    x, regressor = table.values, estimator
    if hasattr(estimator, "steps"):  # a Pipeline: its transforms, then the regressor's draws
        x, regressor = estimator[:-1].transform(x), estimator[-1]
    with status(f"drawing {n:,} samples at {len(table.values):,} points", quiet):
        draws = regressor.sample_y(x, n_samples=n, random_state=seed)
    draws = draws.reshape(draws.shape[0], -1)  # several targets: target-major columns
    names = [f"sample_{i}" for i in range(n)] if draws.shape[1] == n else [
        f"target_{j}_sample_{i}" for j in range(draws.shape[1] // n) for i in range(n)]
    if out is not None:
        outputs.publish({out: encode_table(draws, names, out.suffix)})
    if out is None and not json_output:
        _print_predictions(names, draws)
        return
    summary = {"model": str(model), "data": str(data), "points": len(draws), "samples": n,
               "seed": seed, "rows_dropped": table.dropped,
               "output": None if out is None else str(out), "seconds": round(clock.seconds, 3)}
    print_summary(summary, json_output, quiet, _format_sample)


def _format_sample(s: dict) -> str:
    return (f"drew {s['samples']:,} samples at {s['points']:,} points with {s['model']}"
            + (f"; wrote {s['output']}" if s["output"] else "") + f" ({s['seconds']:.2f} s)")


def _open_model(model: Path, data: Path, columns, by_position: bool, **read):
    """The saved model (its key checked) and DATA's feature columns for it: what `predict` and
    `sample` start from."""
    model_key = _model_key()
    if not model.is_file():
        raise CLIError(f"model file {str(model)!r} does not exist or is not a file")
    estimator, metadata = _load_regressor(model, model_key)
    table = _read_features(data, parse_columns(columns), metadata.get("features"),
                           estimator.n_features_in_, by_position=by_position, **read)
    return estimator, table


def _load_regressor(path: Path, key: str | None):
    """The model in ``path``, verified with ``key``, and its metadata; refuses a model that
    cannot predict and feature names that do not fit it."""
    from scalegp.persistence import ModelFileError, load_model

    try:
        estimator, metadata = load_model(path, return_metadata=True, key=key)
    except ModelFileError as error:  # bad input (exit 2), whatever exception it derives from
        raise CLIError(str(error)) from error
    if not hasattr(estimator, "predict"):
        raise CLIError(f"{path} holds a fitted {type(estimator).__name__} without a regressor: "
                       "this model cannot predict; give a model from 'scalegp gp fit --model'")
    trained_on = metadata.get("features")
    if trained_on is not None and not (
            isinstance(trained_on, list) and all(isinstance(c, str) for c in trained_on)
            and len(trained_on) == estimator.n_features_in_):
        raise CLIError(f"{path}: its feature names ({str(trained_on)[:80]}) are not "
                       f"{estimator.n_features_in_} strings; the file is damaged")
    return estimator, metadata


def _read_features(data: Path, chosen: list[str] | None, trained_on: list[str] | None,
                   n_features: int, *, by_position: bool, key, delimiter, missing) -> Table:
    """The feature columns of ``data``: those ``chosen``, else those named as in training (a
    CSV's, unless ``by_position``), else all, in order."""
    # Parse only the chosen columns, so that e.g. a text id column may stay in the file.
    table = read_table(data, key=key, delimiter=delimiter, columns=chosen, missing=None)
    if chosen is None and trained_on and _has_column_names(data) and not by_position:
        absent = [c for c in trained_on if c not in table.columns]
        if absent:  # as scikit-learn: names that differ are an error, not a positional match
            raise CLIError(f"{data} has no column {', '.join(map(repr, absent))}; the model was "
                           f"trained on {', '.join(trained_on)}. Rename the columns, choose "
                           "them with --columns, or pass --by-position to use them in order")
        table = table.column_subset(trained_on)  # the training columns, in any order
    table = apply_missing_policy(table, missing)
    if table.values.shape[1] != n_features:
        raise CLIError(f"{data} gives {table.values.shape[1]} feature columns, the model needs "
                       f"{n_features} ({', '.join(trained_on or [])}); choose them with "
                       "--columns")
    return table


def _print_predictions(names: list[str], values: np.ndarray) -> None:
    """The predictions as CSV on stdout, with a header."""
    typer.echo(",".join(names))
    for row in values:
        typer.echo(",".join(f"{v:.9g}" for v in row))


def _format_predict(s: dict) -> str:
    return (f"predicted {s['points']:,} points with {s['model']}"
            + (f"; wrote {s['output']}" if s["output"] else "") + f" ({s['seconds']:.2f} s)")
