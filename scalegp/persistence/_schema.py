"""What a model file may hold: the format's name, versions and keys, and the allow-listed
classes with their parameters and attributes, their types and shapes
(`class_specs`)."""

from __future__ import annotations

import dataclasses
import re

from scalegp.estimators import SOLVERS, ScalableGPClassifier, ScalableGPRegressor
from scalegp.ops import IMPLEMENTATIONS, SCHEMES
from scalegp.persistence._kernels import decode_kernel
from scalegp.persistence._values import choice, flag, integer, optional, real, reals

FORMAT = "scalegp-model"
#: The version written. It changes when a file could hold something an older scalegp cannot
#: read; a newer scalegp keeps reading the older versions in `READ_VERSIONS` where it can.
#: 3: ScalableGPRegressor's ``kernel`` and ``alpha`` parameters and ``kernel_`` attribute
#: (scikit-learn kernels as JSON trees, `scalegp.persistence._kernels`). Version 2 files (the
#: default model only) load as models with ``kernel=None``, ``kernel_`` rebuilt.
#: 4: ScalableGPRegressor's ``n_targets`` and ``copy_X_train`` parameters, ``alpha`` one value
#: per training point, optimizer "fmin_l_bfgs_b". Version 3 files load with the defaults.
#: 5: its ``prune`` and ``prune_tol`` parameters; older files load with the defaults.
#: 6: ScalableGPClassifier (a class older files cannot name).
#: 7: ScalableGPRegressor's ``full_data_tol``, and its ``log_marginal_likelihood_value_`` may be
#: absent (not evaluated); older files load with the default.
#: 8: ScalableGPClassifier's ``_scale``, the units it is fitted in (X's over it); older
#: classifiers were fitted in X's units and load with 1.
FORMAT_VERSION = 8
READ_VERSIONS = (2, 3, 4, 5, 6, 7, 8)
#: What each older version lacks: {first version with them: {class: (parameters,
#: attributes)}}.
_ABSENT_BEFORE = {
    3: {"scalegp.ScalableGPRegressor": (("kernel", "alpha"), ("kernel_",))},
    4: {"scalegp.ScalableGPRegressor": (("n_targets", "copy_X_train"), ())},
    5: {"scalegp.ScalableGPRegressor": (("prune", "prune_tol"), ())},
    7: {"scalegp.ScalableGPRegressor": (("full_data_tol",), ())},
    8: {"scalegp.ScalableGPClassifier": ((), ("_scale",))},
}
#: The first version of each class added after version 2; an older file cannot name it.
_CLASS_FROM = {"scalegp.ScalableGPClassifier": 6}
HEADER_KEY = "__scalegp_header__"
#: The JSON header is read whole before anything is checked: cap it (a model's header is a few
#: kB plus the feature names).
MAX_HEADER_CHARS = 4 * 2**20
ARRAY_KEY = re.compile(r"^[A-Za-z0-9_.]{1,200}$")
STEP_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")


# ---------------------------------------------------------------------------------------------
# the schema: classes, their parameters (JSON values) and fitted attributes


def _mesh(value, where):
    # A Mesh object is saved as None: it names this machine's devices.
    return value if value == "all" else optional(integer(1))(value, where)


@dataclasses.dataclass(frozen=True)
class Attr:
    """A fitted attribute: a JSON value (``kind`` int, real, bool, str or kernel, a
    scikit-learn kernel as `scalegp.persistence._kernels` encodes it) or an array (``kind``
    array) of one of ``dtypes`` (``"U"``: text of any length) with ``shape`` in named sizes
    (n training points, d features, o targets, k LOVE rank, t parameters; "y" is (n,) or (n, o)
    as ``_y_1d``; a classifier's c classes, b binary problems, p kernel parameters). ``kind``
    derived: state rebuilt at load from the rest, never stored. ``stacked``: a list of
    equal-shape arrays (or numbers), stored as one array along a first axis; ``as_object``: text
    loaded as an object array, as scikit-learn keeps it."""

    kind: str
    shape: tuple | str = ()
    dtypes: tuple = ("<f8", "<f4")
    minimum: float | None = None  # values >= minimum (> with strict)
    maximum: int = 2**63 - 1     # int attributes
    strict: bool = False
    choices: tuple = ()
    none: bool = False      # None is allowed
    scalar: bool = False    # an array attribute that may also be a JSON number
    required: bool = True
    finite: bool = True
    cache: bool = False     # stored only with store_variance_cache
    stacked: bool = False   # a list of arrays (or numbers), stored stacked
    as_object: bool = False  # text loaded as an object array


_INTS = ("<i8", "<i4")
_POSITIVE = dict(minimum=0.0, strict=True)


def class_specs(version: int = FORMAT_VERSION) -> dict[str, tuple[type, dict, dict]]:
    """Per allow-listed class: the class, its parameters' checks, its attributes, as format
    ``version`` has them."""
    specs = {name: spec for name, spec in _all_specs().items()
             if version >= _CLASS_FROM.get(name, 0)}
    for first, absent in _ABSENT_BEFORE.items():
        if version >= first:
            continue
        for name, (params, attributes) in absent.items():
            if name not in specs:  # a class the version cannot name at all
                continue
            cls, param_checks, attr_specs = specs[name]
            specs[name] = (cls, {k: v for k, v in param_checks.items() if k not in params},
                           {k: v for k, v in attr_specs.items() if k not in attributes})
    return specs


def _all_specs() -> dict[str, tuple[type, dict, dict]]:
    from sklearn.pipeline import Pipeline
    from sklearn.preprocessing import StandardScaler

    features = dict(n_features_in_=Attr("int", minimum=1),
                    feature_names_in_=Attr("array", ("d",), ("U",), required=False,
                                           as_object=True))
    return {
        "scalegp.ScalableGPRegressor": (ScalableGPRegressor, dict(
            kernel=optional(decode_kernel), alpha=reals, lengthscale=reals, outputscale=real, noise=real, noise_lower_bound=real,
            mean=optional(reals), normalize_y=flag, copy_X_train=flag,
            n_targets=optional(integer(1)),
            optimizer=choice("L-BFGS-B", "fmin_l_bfgs_b", "adam", None), learning_rate=real,
            n_restarts_optimizer=integer(0), max_iter=integer(0), solver=choice(*SOLVERS),
            exact_max_n=integer(1), subset_size=integer(2), max_iter_full=integer(0),
            full_data_tol=real, num_probes=integer(1), preconditioner_rank=integer(1),
            cg_tol=real, max_cg_iter=integer(1), love_rank=integer(1),
            dtype=choice(None, "float32", "float64"), impl=choice("auto", *IMPLEMENTATIONS),
            mesh=_mesh,
            mesh_scheme=choice(*SCHEMES), prune=choice(True, False, "auto"),
            prune_tol=optional(real), verbose=lambda v, w: flag(v, w) if isinstance(
                v, bool) else integer(0)(v, w),
            random_state=optional(integer(0)),
        ), dict(
            features,
            X_train_=Attr("array", ("n", "d")),
            y_train_=Attr("array", "y", ("<f8", "<f4", "|b1", "|i1", "|u1", "<i2", "<u2",
                                          "<u4", "<u8") + _INTS),
            alpha_=Attr("array", "y"),
            theta_=Attr("array", ("t",), ("<f8",)),
            _y_train_mean=Attr("array", ("o",), ("<f8",)),
            _y_train_std=Attr("array", ("o",), ("<f8",), **_POSITIVE),
            _fixed_mean=Attr("array", ("o",), ("<f8",), none=True),
            _y_1d=Attr("bool"),
            solver_=Attr("str", choices=("exact", "bbmm")),
            _probe_seed=Attr("int", minimum=0, maximum=2**31 - 2),
            # the default model's (kernel=None) only: required there (_check_consistency)
            lengthscale_=Attr("array", ("d",), ("<f8",), **_POSITIVE, required=False),
            outputscale_=Attr("real", **_POSITIVE, required=False),
            kernel_=Attr("kernel"),
            _spec=Attr("derived"),
            _fixed_noise=Attr("derived"),  # alpha for the training points, from the params
            # with a kernel: its WhiteKernel terms (0 without any; version 3 files: plus alpha)
            noise_=Attr("real", minimum=0.0),
            mean_=Attr("array", ("o",), ("<f8",)),
            n_iter_=Attr("int", minimum=0),
            # absent where the fit took no BBMM step on all data (evaluated when read)
            log_marginal_likelihood_value_=Attr("real", finite=False, required=False),
            _cholesky=Attr("array", ("n", "n"), none=True, cache=True),
            _love_factor=Attr("array", ("n", "k"), none=True, cache=True),
        )),
        "scalegp.ScalableGPClassifier": (ScalableGPClassifier, dict(
            kernel=optional(decode_kernel),
            optimizer=choice("fmin_l_bfgs_b", "L-BFGS-B", None),
            n_restarts_optimizer=integer(0), max_iter_predict=integer(1), warm_start=flag,
            copy_X_train=flag, random_state=optional(integer(0)),
            multi_class=choice("one_vs_rest"), n_jobs=optional(integer(-2**31, 2**31 - 1)),
            solver=choice("auto", "exact", "cg"), exact_max_n=integer(1),
            subset_size=integer(2), max_iter=integer(0), max_iter_full=integer(0),
            num_probes=integer(1), preconditioner_rank=integer(1), cg_tol=real,
            max_cg_iter=integer(1), dtype=choice(None, "float32", "float64"),
            impl=choice("auto", *IMPLEMENTATIONS),
        ), dict(
            features,
            # the labels: numbers, booleans or text, sorted and distinct (np.unique's)
            classes_=Attr("array", ("c",), ("<f8", "<f4", "|b1", "U") + _INTS),
            n_classes_=Attr("int", minimum=2), solver_=Attr("str", choices=("exact", "cg")),
            _probe_seed=Attr("int", minimum=0, maximum=2**31 - 2),
            _centre=Attr("array", ("d",), ("<f8",)),
            # the inputs' units, a power of two (version 7 and older: 1, X's own)
            _scale=Attr("real", **_POSITIVE),
            X_train_=Attr("array", ("n", "d")),
            _codes=Attr("array", ("n",), _INTS, minimum=0),  # each point's class, < c
            # one per binary problem (1 for two classes, else one per class)
            _thetas=Attr("array", ("b", "p"), ("<f8",), stacked=True),  # in X's over _scale
            _alphas=Attr("array", ("b", "n"), stacked=True),
            _factors=Attr("array", ("b", "n", "k"), stacked=True),
            _modes=Attr("array", ("b", "n"), stacked=True),
            _values=Attr("array", ("b",), ("<f8",), stacked=True, finite=False),
            log_marginal_likelihood_value_=Attr("real", finite=False),
            n_iter_=Attr("int", minimum=0),
            _spec=Attr("derived"),     # from kernel (or the default model's for d features)
            kernel_=Attr("derived"),   # that kernel at each problem's theta
        )),
        "sklearn.preprocessing.StandardScaler": (StandardScaler, dict(
            copy=flag, with_mean=flag, with_std=flag,
        ), dict(
            features,
            n_samples_seen_=Attr("array", ("d",), ("<f8",) + _INTS, minimum=0, scalar=True),
            mean_=Attr("array", ("d",), ("<f8",), none=True),
            var_=Attr("array", ("d",), ("<f8",), minimum=0, none=True),
            scale_=Attr("array", ("d",), ("<f8",), **_POSITIVE, none=True),
        )),
        # memory=None: a file must not pick a folder that a later fit writes and unpickles.
        "sklearn.pipeline.Pipeline": (Pipeline, dict(
            memory=choice(None), transform_input=choice(None), verbose=flag,
        ), {}),
    }
