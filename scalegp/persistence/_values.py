"""The error a model file raises, and the checks of the JSON values in its header: each check
returns the value it was given (a list of numbers as a float64 array) or raises
:class:`ModelFileError` naming where in the header the value is and what was expected."""

from __future__ import annotations

import numpy as np


class ModelFileError(ValueError):
    """A model file that cannot be loaded: not a scalegp model, corrupt, edited or inconsistent."""


def fail(where: str, problem: str):
    raise ModelFileError(f"{where}: {problem}")


def _finite_number(value) -> bool:
    """A JSON number (not a bool) that is finite as a float (a huge integer is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return bool(np.isfinite(float(value)))
    except OverflowError:
        return False


def real(value, where):
    if not _finite_number(value):
        fail(where, f"expected a finite number, got {value!r:.80}")
    return value


def integer(minimum, maximum=2**63 - 1):
    def check(value, where):
        if isinstance(value, bool) or not isinstance(value, int) \
                or not minimum <= value <= maximum:
            fail(where, f"expected an integer in [{minimum}, {maximum}], got {value!r}")
        return value
    return check


def flag(value, where):
    if not isinstance(value, bool):
        fail(where, f"expected true or false, got {value!r}")
    return value


def choice(*options):
    def check(value, where):
        if not any(value is o or (isinstance(value, str) and value == o) for o in options):
            fail(where, f"expected one of {', '.join(map(repr, options))}, got {value!r}")
        return value
    return check


def reals(value, where):
    """A number, or a non-empty list of numbers (saved from an array)."""
    if isinstance(value, list):
        if not value:
            fail(where, "expected a number or a non-empty list of numbers, got []")
        return np.asarray([real(v, f"{where}[{i}]") for i, v in enumerate(value)], np.float64)
    return real(value, where)


def optional(check):
    return lambda value, where: None if value is None else check(value, where)
