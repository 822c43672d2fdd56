"""The training data of `scalegp gp fit`: features and targets from one table (a target column)
or from two files (--y), row for row, and the random held-out split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .common import CLIError
from .io import apply_missing_policy, read_table


@dataclass
class TrainingData:
    """What `gp fit` learns from: features x (n, d) and targets y (n,), with their names."""

    x: np.ndarray
    y: np.ndarray
    features: list[str]
    target: str
    dropped: int  # rows skipped for missing values


def read_training_data(data: Path, target: str | None, y: Path | None, *,
                       features: list[str] | None, key, y_key, delimiter,
                       missing) -> TrainingData:
    """The target column ``target`` of ``data``, or (without one) the targets in ``y``."""
    read = dict(features=features, key=key, delimiter=delimiter, missing=missing)
    return (_read_with_target_column(data, target, **read) if target is not None
            else _read_with_target_file(data, y, y_key=y_key, **read))


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
