"""The training data of `scalegp gp fit`: features and targets from one table (a target column)
or from two files (--y), row for row, and the random held-out split; with ``--classify`` the
targets are class labels (text or whole numbers), checked. Also the models `gp fit` trains (a
StandardScaler and a GP regressor or classifier, in a Pipeline), what its summary says of them,
and their scores on the held-out rows."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .common import CLIError, status
from .io import Table, apply_missing_policy, read_labels, read_table

#: ``--classify``: at most this many distinct labels (one binary GP is fitted per class).
MAX_CLASSES = 50


@dataclass
class TrainingData:
    """What `gp fit` learns from: features x (n, d) and targets y (n,) (float64, or class
    labels: int64 or text), with their names."""

    x: np.ndarray
    y: np.ndarray
    features: list[str]
    target: str
    dropped: int  # rows skipped for missing values


def read_training_data(data: Path, target: str | None, y: Path | None, *,
                       features: list[str] | None, key, y_key, delimiter,
                       missing, labels: bool = False) -> TrainingData:
    """The target column ``target`` of ``data``, or (without one) the targets in ``y``; class
    labels with ``labels`` (`class_labels`)."""
    read = dict(features=features, key=key, delimiter=delimiter, missing=missing)
    if labels:
        return _read_labelled(data, target, y, y_key=y_key, **read)
    return (_read_with_target_column(data, target, **read) if target is not None
            else _read_with_target_file(data, y, y_key=y_key, **read))


def _read_labelled(data: Path, target: str | None, y: Path | None, *,
                   features: list[str] | None, key, y_key, delimiter, missing) -> TrainingData:
    """Features and class labels: the labels' column is read as written (text allowed), the
    features as numbers; a row missing either is an error or dropped, as ``missing`` says."""
    source, column = (data, target) if target is not None else (y, "0")
    labels, absent, name, columns = read_labels(source, column, what="data" if y is None
                                                else "target", key=key if y is None else y_key,
                                                delimiter=delimiter)
    if y is not None:
        if len(columns) != 1:
            raise CLIError(f"--y {y} has {len(columns)} columns; give one column of labels")
        name = name if columns != ["0"] else "y"
        names = None
    else:
        names = features or [c for c in columns if c != name]
        if name in names:
            raise CLIError(f"column {name!r} is both the target and a feature")
        if not names:
            raise CLIError(f"{data} has only the target column {name!r}; no features")
    table = read_table(data, key=key, delimiter=delimiter, columns=names, missing=None,
                       columns_option="--features")
    if len(labels) != len(table.values):
        raise CLIError(f"--y {y} has {len(labels)} rows, {data} has {len(table.values)}; they "
                       "must match row for row")
    # the rows' numbers ride along as a last column, NaN where the label is missing: the
    # missing-value policy then treats a missing label as it treats a missing feature
    rows = np.where(absent, np.nan, np.arange(len(labels)))
    table = apply_missing_policy(Table(np.column_stack([table.values, rows]),
                                       table.columns + [name], table.path), missing)
    kept = table.values[:, -1].astype(np.int64)
    return TrainingData(table.values[:, :-1], class_labels(labels[kept], name), table.columns[:-1],
                        name, table.dropped)


def class_labels(labels: np.ndarray, name: str) -> np.ndarray:
    """Labels as `gp fit --classify` fits them: whole numbers as int64 (``1`` and ``1.0`` are one
    class), anything else as text; refused when they look like a continuous target (numbers
    that are not whole, or more than `MAX_CLASSES` distinct values) or hold one class."""
    numbers = _as_numbers(labels)
    if numbers is not None:
        fraction = numbers[numbers != np.round(numbers)]
        if len(fraction):
            raise CLIError(f"--classify: column {name!r} holds numbers that are not whole (e.g. "
                           f"{fraction[0]:g}), a continuous target; fit it without --classify "
                           "(regression), or give class labels")
        labels = numbers.astype(np.int64)
    classes = np.unique(labels)
    if len(classes) > MAX_CLASSES:
        raise CLIError(f"--classify: column {name!r} has {len(classes)} distinct values, more "
                       f"than the {MAX_CLASSES} classes allowed; a target with that many values "
                       "is continuous: fit it without --classify (regression)")
    if len(classes) < 2:
        raise CLIError(f"--classify: column {name!r} holds one class "
                       f"({classes[0].item()!r}); give labels of at least two classes")
    return labels


def _as_numbers(labels: np.ndarray) -> np.ndarray | None:
    """float64 labels when every one is a finite number, else None (text)."""
    if labels.dtype.kind == "f":
        return labels
    try:
        numbers = labels.astype(np.float64)
    except ValueError:
        return None
    return numbers if np.all(np.isfinite(numbers)) else None


def _read_with_target_column(data: Path, target: str, *, features: list[str] | None,
                             key, delimiter, missing) -> TrainingData:
    """The target column of ``data``, and the features: ``features``, or every other column."""
    # Parse only the columns used, so that e.g. a text id column may stay in the file.
    wanted = None if features is None else features + [target]
    table = read_table(data, key=key, delimiter=delimiter, columns=wanted, missing=None,
                       columns_option="--features")
    target_name = table.column_subset([target]).columns[0]
    names = features or [c for c in table.columns if c != target_name]
    if target_name in table.column_subset(names).columns:
        raise CLIError(f"column {target_name!r} is both the target and a feature")
    if not names:
        raise CLIError(f"{data} has only the target column {target_name!r}; no features")
    table = apply_missing_policy(table.column_subset(names + [target_name]), missing)
    return TrainingData(table.values[:, :-1], table.values[:, -1], table.columns[:-1],
                        table.columns[-1], table.dropped)


def _read_with_target_file(data: Path, y: Path, *, features: list[str] | None, key, y_key,
                           delimiter, missing) -> TrainingData:
    """The features from ``data``, the targets from the one column of ``y``, row for row."""
    table = read_table(data, key=key, delimiter=delimiter, columns=features, missing=missing,
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
    target_name = y_table.columns[0] if y_table.columns != ["0"] else "y"
    return TrainingData(table.values, y_table.values[:, 0], table.columns, target_name, 0)


def check_split_classes(y: np.ndarray, train: np.ndarray, test_size: float) -> None:
    """Every class keeps training points after the split (a class the model never saw could
    not be predicted, nor scored)."""
    classes, counts = np.unique(y, return_counts=True)
    unseen = np.setdiff1d(classes, y[train])
    if len(unseen):
        count = counts[np.searchsorted(classes, unseen[0])]
        raise CLIError(f"--test-size {test_size} leaves class {unseen[0].item()!r} ({count} "
                       "points) without training points; lower --test-size or give more points "
                       "of that class")


def classification_scores(estimator, x: np.ndarray, truth: np.ndarray,
                          train_labels: np.ndarray) -> dict:
    """Held-out accuracy and log-loss (mean negative log probability of the true class), and
    both for the training class frequencies as a baseline (the majority class's accuracy)."""
    from sklearn.metrics import log_loss

    classes = estimator.classes_
    proba = estimator.predict_proba(x)
    frequencies = np.array([np.mean(train_labels == c) for c in classes])
    return {
        "test_accuracy": float(np.mean(estimator.predict(x) == truth)),
        "test_log_loss": float(log_loss(truth, proba, labels=classes)),
        "test_accuracy_of_majority_class": float(np.mean(truth == classes[np.argmax(
            frequencies)])),
        "test_log_loss_of_class_frequencies": float(log_loss(
            truth, np.tile(frequencies, (len(truth), 1)), labels=classes)),
    }


def split_rows(n: int, test_size: float, seed: int):
    """(training, held-out) row indices, each sorted; the held-out ones a random ``test_size``."""
    if not 0 <= test_size < 1:
        raise CLIError(f"--test-size must be in [0, 1), got {test_size}")
    order = np.random.default_rng(seed).permutation(n)
    n_test = int(round(test_size * n))
    if test_size > 0 and not 1 <= n_test <= n - 2:
        raise CLIError(f"--test-size {test_size} leaves {n_test} test and {n - n_test} training "
                       f"points of {n}; choose a size that keeps both non-empty")
    return np.sort(order[n_test:]), np.sort(order[:n_test])


def _pipeline(standardize: bool, gp):
    """StandardScaler (optional) then the GP, as one Pipeline: saved and loaded together."""
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    return Pipeline(([("scale", StandardScaler())] if standardize else []) + [("gp", gp)])


def make_regressor(standardize: bool, kernel, **settings):
    """StandardScaler (optional) then a ScalableGPRegressor, as one Pipeline."""
    from scalegp import ScalableGPRegressor

    # kernel= only when asked: a scalegp without the parameter still fits the default model.
    chosen = {} if kernel is None else {"kernel": kernel}
    return _pipeline(standardize, ScalableGPRegressor(**chosen, **settings))


def make_classifier(standardize: bool, kernel, lengthscale: float | None, d: int,
                     solver: str, **settings):
    """StandardScaler (optional) then a ScalableGPClassifier, as one Pipeline; --lengthscale
    starts the default model (ConstantKernel * RBF, one lengthscale per feature) there."""
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel

    from scalegp import ScalableGPClassifier

    if kernel is None and lengthscale is not None:
        kernel = ConstantKernel(1.0, (1e-5, 1e5)) * RBF(np.full(d, lengthscale), (1e-5, 1e5))
    gp = ScalableGPClassifier(kernel, solver={"bbmm": "cg"}.get(solver, solver), **settings)
    return _pipeline(standardize, gp)


def host_only_for(solver: str | None) -> None:
    """Keeps JAX to the host CPU (`scalegp._runtime.host_only`) for a command whose model is
    fitted, or was, by the exact solver (``solver``: the fit's choice or a fitted model's
    ``solver_``), on a machine whose accelerator sends that work to its host (a TPU:
    `scalegp.ops.dense_work_on_host`; the fit and every prediction of the model run there):
    the accelerator's client would start and shut down for nothing (docs/decisions.md #63)."""
    from scalegp._runtime import attached_accelerator, host_only
    from scalegp.ops import dense_work_on_host

    if solver != "exact":
        return
    platform = attached_accelerator()
    if platform is not None and dense_work_on_host(platform):
        host_only()


def classifier_summary(gp, dtype: str, standardize: bool) -> dict:
    """The fitted classifier's labels, kernels (one per binary problem: one for two classes,
    one per class against the rest for more) and optimiser result."""
    kernels = getattr(gp.kernel_, "kernels", [gp.kernel_])  # a CompoundKernel's: per class
    return {"task": "classification", "classes": [c.item() for c in gp.classes_],
            "solver": gp.solver_, "dtype": dtype, "kernel": [str(k) for k in kernels],
            "lengthscale_units": "standardized features" if standardize else "features",
            "log_marginal_likelihood": gp.log_marginal_likelihood_value_,
            "optimizer_iterations": gp.n_iter_}


def regressor_summary(gp, dtype: str, standardize: bool, normalize_y: bool,
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
        # None where the fit took no BBMM step on all data: reading the attribute would
        # evaluate it there, as costly as such a step (full_data_tol)
        "log_marginal_likelihood": vars(gp).get("log_marginal_likelihood_value_"),
        "optimizer_iterations": gp.n_iter_,
    }


def regression_scores(estimator, training: TrainingData, train: np.ndarray, test: np.ndarray,
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


def parse_kernel_option(text: str | None, lengthscale: float | None, noise: float,
                         classify: bool = False):
    """--kernel as a scikit-learn kernel (None without it), checked before any work; with
    ``classify`` the latent function's kernel, without the white noise the formula adds when
    it names none (the noise of a regression's targets)."""
    if text is None:
        return None
    if lengthscale is not None:  # refused rather than ignored: the user expects it to count
        raise CLIError("--lengthscale sets the default model's lengthscale; with --kernel give "
                       "lengthscales in the formula, e.g. --kernel 'rbf(lengthscale=2)'")
    from .kernel_spec import parse_kernel

    return parse_kernel(text, noise=noise, add_noise=not classify)
