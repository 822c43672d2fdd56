"""`scalegp gp fit`, `scalegp gp predict` and `scalegp gp sample`: GP regression (and with
``--classify`` classification) on files, with safe model files (:mod:`scalegp.persistence`,
never pickle)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
import typer

from .common import CLIError, Choice, Debug, Delimiter, Force, Json, Key, Missing, Quiet, \
    Stopwatch, parse_columns, print_summary, reports_errors, shows_progress, status
from .io import Outputs, Table, apply_missing_policy, encode_table, print_table, read_header, \
    read_table
from .gp_summary import format_fit, format_predict, format_sample
from .kernel_spec import HELP as KERNEL_HELP
from .training import MAX_CLASSES, TrainingData, check_split_classes, classification_scores, \
    classifier_summary, host_only_for, make_classifier, make_regressor, \
    parse_kernel_option, read_training_data, regression_scores, regressor_summary, split_rows

#: A secret here signs the model files that `gp fit` writes and is required by `gp predict`.
MODEL_KEY_ENV = "SCALEGP_MODEL_KEY"

DataPath = Annotated[Path, typer.Argument(help="Feature table: .npy, .npz or .csv (with a "
                                                "header).", show_default=False)]


class Solver(Choice):
    auto = "auto"
    exact = "exact"
    bbmm = "bbmm"


# `gp fit`'s options (the shared ones are in .common)
Classify = Annotated[bool, typer.Option(
    "--classify", help="Classify: the target holds class labels, text or whole numbers with 2 "
    f"to {MAX_CLASSES} distinct values (more, or numbers with fractions, is a continuous target: "
    "refused), fitted by ScalableGPClassifier (Laplace, one-vs-rest); reports held-out "
    "accuracy and log-loss. --normalize-y, --noise and --plot are for regression; --kernel "
    "gets no white noise unless it names one.")]
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
         "(exact up to 4,096 points; 2,048 with --classify).", parser=Solver.parser("--solver"))]
MaxIter = Annotated[int, typer.Option(
    help="L-BFGS-B iterations for the hyperparameters (on the subset for bbmm).", min=0)]
SubsetSize = Annotated[int, typer.Option(
    help="bbmm: hyperparameters first on a random subset of this size.", min=2)]
MaxIterFull = Annotated[int, typer.Option(
    help="bbmm: then at most this many scoring steps per stage, on growing subsets and "
         "last on all the data (0 skips).", min=0)]
FullDataTol = Annotated[Optional[float], typer.Option(
    help="bbmm regression: take the steps on all the data only where they are expected to "
         "gain more than this many nats per point over the last subset's fit (default 1e-3; "
         "0 always takes them).", min=0, show_default=False)]
CgTol = Annotated[float, typer.Option(help="bbmm: conjugate-gradient tolerance.")]
TestSize = Annotated[float, typer.Option(
    help="Hold out this fraction (random) and report its RMSE and NLL (accuracy and "
         "log-loss with --classify).")]
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
    classify: Classify = False,
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
    full_data_tol: FullDataTol = None,
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

      scalegp gp fit iris.csv --target species --classify --test-size 0.3 --model iris.npz
    """
    clock = Stopwatch()
    _check_fit_options(target, y, cg_tol, classify and plot is not None,
                       classify and full_data_tol is not None)
    _check_restarts(restarts)
    kernel_object = parse_kernel_option(kernel, lengthscale, noise, classify)
    outputs = Outputs(force=force, inputs=[data] + ([y] if y is not None else []))
    model = outputs.add(model, option="--model", suffixes=(".npz",))
    plot = outputs.add(plot, option="--plot", suffixes=(".png",))
    signing_key = _model_key() if model is not None else None  # checked before the fit
    training = read_training_data(data, target, y, features=parse_columns(features, "--features"),
                                  key=key, y_key=y_key, delimiter=delimiter, missing=missing,
                                  labels=classify)
    if plot is not None:
        _check_plot(training)
    train, test = split_rows(len(training.x), test_size, seed)
    if classify:
        check_split_classes(training.y, train, test_size)
    dtype = "float64" if float64 else "float32"  # the estimator scopes x64 itself
    settings = dict(n_restarts_optimizer=restarts, dtype=dtype, max_iter=max_iter,
                    subset_size=subset_size, max_iter_full=max_iter_full, cg_tol=cg_tol,
                    random_state=seed)
    estimator = make_classifier(standardize, kernel_object, lengthscale, training.x.shape[1],
                                 solver.value, **settings) if classify else make_regressor(
        standardize, kernel_object, lengthscale=1.0 if lengthscale is None else lengthscale,
        noise=noise, normalize_y=normalize_y, solver=solver.value,
        **({} if full_data_tol is None else {"full_data_tol": full_data_tol}), **settings)
    host_only_for(estimator[-1]._solver_for(len(train)))
    fit_seconds = _fit_with_progress(estimator, training.x[train], training.y[train], quiet)
    summary = {"data": str(data), "train_points": len(train), "test_points": len(test),
               "features": training.features, "target": training.target,
               "rows_dropped": training.dropped,
               **(classifier_summary(estimator[-1], dtype, standardize) if classify
                  else regressor_summary(estimator[-1], dtype, standardize, normalize_y,
                                         kernel is not None)),
               "fit_seconds": round(fit_seconds, 3)}
    if len(test) and classify:
        with status(f"predicting {len(test):,} held-out points", quiet):
            summary.update(classification_scores(estimator, training.x[test], training.y[test],
                                                 training.y[train]))
    elif len(test):
        summary.update(regression_scores(estimator, training, train, test, quiet))
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
    print_summary(summary, json_output, quiet, format_fit)


def _check_fit_options(target: str | None, y: Path | None, cg_tol: float,
                       plot_classes: bool, tol_classes: bool) -> None:
    if (target is None) == (y is None):
        raise CLIError("give the targets with exactly one of --target COLUMN or --y FILE")
    if tol_classes:
        raise CLIError("--full-data-tol applies to regression; the classifier's stages have "
                       "no such test: drop it with --classify")
    if plot_classes:
        raise CLIError("--plot draws a regression fit; drop it with --classify (or see "
                       "examples/gp_classification.py for a plot of class probabilities)")
    if not (cg_tol > 0 and math.isfinite(cg_tol)):
        raise CLIError(f"--cg-tol must be a positive number, got {cg_tol}")


#: Bytes the optimiser holds per starting point, at least: a float64 array of one value (a
#: numpy array's header and its list entry; more with more hyperparameters).
START_BYTES = 128


def _check_restarts(restarts: int) -> None:
    """Before any work: the optimiser makes all its starting points first, which must fit in
    memory (--restarts 10**12 made them for hours, then ran out)."""
    from scalegp._validation import MemoryLimitError, check_memory

    try:
        check_memory((restarts + 1) * START_BYTES, f"{restarts + 1:,} starting points of the "
                     "optimiser", "use fewer restarts (each one is a whole fit)")
    except MemoryLimitError as error:
        raise CLIError(f"--restarts {restarts}: {error}") from None


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


def _fit_with_progress(estimator, x: np.ndarray, y: np.ndarray, quiet: bool) -> float:
    """Fits ``estimator``; returns the seconds the fit took."""
    # On a terminal the estimator reports its phases on stderr, each with its elapsed time and
    # an estimate of what remains: a bar per optimiser phase with tqdm (the progress extra),
    # lines without it. No spinner here: its live line would garble those.
    if shows_progress(quiet):
        typer.echo(f"fitting a GP to {len(x):,} points x {x.shape[1]} features", err=True)
        if "verbose" in estimator[-1].get_params():  # the regressor's phases
            estimator[-1].set_params(verbose=1)
    clock = Stopwatch()
    estimator.fit(x, y)
    return clock.seconds


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


@reports_errors
def predict(
    model: ModelPath,
    data: DataPath,
    out: Annotated[Optional[Path], typer.Option(
        help="Write predictions here (.npy or .csv): the mean, and with --std a second column; "
             "a classifier's labels, or with --proba its probabilities.")] = None,
    std: Annotated[bool, typer.Option("--std", help="Also the predictive standard deviation of "
                                                     "y (noise included).")] = False,
    proba: Annotated[bool, typer.Option("--proba", help="Classifiers (gp fit --classify): the "
                                                         "probability of each class, one column "
                                                         "per class named after its label, "
                                                         "instead of the labels.")] = False,
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
    """Predict with a saved GP model: a regressor's mean (and --std), a classifier's labels
    (or --proba).

    Examples:

      scalegp gp predict co2.npz examples/data/co2_weekly.csv --std --out co2_pred.csv

      scalegp gp predict gp.npz X_new.npy --out mean.npy

      scalegp gp predict iris.npz new_flowers.csv --proba --out probabilities.csv
    """
    clock = Stopwatch()
    if std and proba:
        raise CLIError("--std is for regression models, --proba for classifiers; give one")
    outputs = Outputs(force=force, inputs=[model, data])
    out = outputs.add(out)
    expect = "classifier" if proba else "regressor" if std else None
    estimator, table = _open_model(model, data, columns, by_position, key=key,
                                   delimiter=delimiter, missing=missing, expect=expect)
    with status(f"predicting {len(table.values):,} points", quiet):
        names, values = _predictions(estimator, table.values, std, proba)
    if out is not None:
        outputs.publish({out: encode_table(values if len(names) > 1 else values[:, 0], names,
                                           out.suffix)})
    if out is None and not json_output:
        print_table(names, values)
        return
    summary = {"model": str(model), "data": str(data), "points": len(values),
               "rows_dropped": table.dropped, "output": None if out is None else str(out),
               "seconds": round(clock.seconds, 3)}
    print_summary(summary, json_output, quiet, format_predict)


def _predictions(estimator, x: np.ndarray, std: bool, proba: bool):
    """Column names and values (n, k): a classifier's probabilities (``proba``) or labels, a
    regressor's mean and (``std``) standard deviation."""
    if proba:
        return [str(c) for c in estimator.classes_], estimator.predict_proba(x)
    if hasattr(estimator, "classes_"):
        return ["label"], estimator.predict(x)[:, None]
    result = estimator.predict(x, return_std=std)
    return ["mean"] + (["std"] if std else []), np.column_stack(result if std else [result])


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
                                   delimiter=delimiter, missing=missing, expect="regressor")
    x, regressor = table.values, estimator
    if hasattr(estimator, "steps"):  # a Pipeline: its transforms, then the regressor's draws
        x, regressor = estimator[:-1].transform(x), estimator[-1]
    draws = _draw(regressor, x, n, seed, out, quiet)
    draws = draws.reshape(draws.shape[0], -1)  # several targets: target-major columns
    names = [f"sample_{i}" for i in range(n)] if draws.shape[1] == n else [
        f"target_{j}_sample_{i}" for j in range(draws.shape[1] // n) for i in range(n)]
    if out is not None:
        outputs.publish({out: encode_table(draws, names, out.suffix)})
    if out is None and not json_output:
        print_table(names, draws)
        return
    summary = {"model": str(model), "data": str(data), "points": len(draws), "samples": n,
               "seed": seed, "rows_dropped": table.dropped,
               "output": None if out is None else str(out), "seconds": round(clock.seconds, 3)}
    print_summary(summary, json_output, quiet, format_sample)


def _draw(regressor, x: np.ndarray, n: int, seed: int, out: Path | None, quiet: bool):
    """``regressor.sample_y``; draws that, with the bytes of their file, need more memory than
    this process can hold are refused before any work, naming --n, the size and the limit."""
    from scalegp._validation import MemoryLimitError, check_memory

    y_shape = np.shape(getattr(regressor, "y_train_", ()))
    values = len(x) * n * (y_shape[1] if len(y_shape) == 2 else 1)
    # a .npy value takes 8 bytes; a CSV one up to 25 characters ("%.17g" and a comma); the
    # file's bytes and their copy are held beside the draws
    per_value = 0 if out is None else 8 if out.suffix.lower() == ".npy" else 25
    try:
        if per_value:
            check_memory(values * (8 + 2 * per_value), f"{n:,} draws at {len(x):,} rows and the "
                         f"bytes of {out.name}", "draw fewer samples at a time (draws with other "
                         "seeds are independent), or at fewer rows")
        with status(f"drawing {n:,} samples at {len(x):,} points", quiet):
            return regressor.sample_y(x, n_samples=n, random_state=seed)
    except MemoryLimitError as error:  # refused before any work
        raise CLIError(f"--n {n}: {error}") from None


def _open_model(model: Path, data: Path, columns, by_position: bool, expect: str | None = None,
                **read):
    """The saved model (its key checked; a regressor or classifier if ``expect`` says so) and
    DATA's feature columns for it: what `predict` and `sample` start from. A model of the exact
    solver keeps JAX to the host where its predictions run there anyway (`host_only_for`)."""
    model_key = _model_key()
    if not model.is_file():
        raise CLIError(f"model file {str(model)!r} does not exist or is not a file")
    estimator, metadata = _load_regressor(model, model_key, expect)
    host_only_for(getattr(estimator[-1] if hasattr(estimator, "steps") else estimator,
                          "solver_", None))
    table = _read_features(data, parse_columns(columns), metadata.get("features"),
                           estimator.n_features_in_, by_position=by_position, **read)
    return estimator, table


#: What a command that needs a regressor or a classifier says of a model of the other kind.
_KIND_HINTS = {"classifier": "--proba needs a model from 'scalegp gp fit --classify'",
               "regressor": "--std and 'gp sample' need a regression model, from 'scalegp gp "
                            "fit' without --classify"}


def _load_regressor(path: Path, key: str | None, expect: str | None = None):
    """The model in ``path``, verified with ``key`` (and of the kind ``expect``), and its
    metadata; refuses a model that cannot predict and feature names that do not fit it."""
    from scalegp.persistence import ModelFileError, load_model

    try:
        estimator, metadata = load_model(path, return_metadata=True, key=key, expect=expect)
    except ModelFileError as error:  # bad input (exit 2), whatever exception it derives from
        hint = f" ({_KIND_HINTS[expect]})" if expect and f"not a {expect};" in str(error) else ""
        raise CLIError(f"{error}{hint}") from error
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
    # Parse only the chosen columns, so that e.g. a text id column (or the labels a classifier
    # was trained on) may stay in the file.
    if chosen is None and trained_on and _has_column_names(data) and not by_position:
        columns = read_header(data, delimiter=delimiter)
        absent = [c for c in trained_on if c not in columns]
        if absent:  # as scikit-learn: names that differ are an error, not a positional match
            raise CLIError(f"{data} has no column {', '.join(map(repr, absent))}; the model was "
                           f"trained on {', '.join(trained_on)}. Rename the columns, choose "
                           "them with --columns, or pass --by-position to use them in order")
        chosen = trained_on  # the training columns, in any order
    table = read_table(data, key=key, delimiter=delimiter, columns=chosen, missing=None)
    table = apply_missing_policy(table, missing)
    if table.values.shape[1] != n_features:
        raise CLIError(f"{data} gives {table.values.shape[1]} feature columns, the model needs "
                       f"{n_features} ({', '.join(trained_on or [])}); choose them with "
                       "--columns")
    return table
