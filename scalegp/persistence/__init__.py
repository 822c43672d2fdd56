"""Model files that cannot run code: fitted estimators as plain arrays plus a JSON header.

``pickle`` (and joblib) files execute code on load, so a model from an untrusted source is a risk.
:func:`save_model` writes a ``.npz`` archive instead: every fitted numeric array under its own key,
uncompressed, and one JSON header with the format version, the estimator's class (from a fixed
allow-list), its parameters, its scalar fitted attributes, the shape and dtype of every array,
user metadata (e.g. feature names) and a SHA-256 checksum over header and arrays.

:func:`load_model` trusts nothing in the file. It reads the header first and checks it against a
schema: only allow-listed classes, each with only its own parameters (of their types; a
Pipeline's ``memory`` is None) and attributes, and array shapes that agree with each other and
with the model's sizes. Only then does it read each array, after checking its ``.npy`` header
against the declared shape and dtype, so no file can make it allocate more than the file holds.
Then come the checksum, the optional signature, and the values (finite, positive where they must
be). Anything else raises :class:`ModelFileError` naming the problem.

The checksum detects corruption, not tampering: anyone can edit a file and recompute it. Loading
an edited file still cannot run code, but it can load a different model. For tamper-evidence,
sign with a secret key (``save_model(..., key=...)``, an HMAC-SHA256) and load with the same key.

By default a file holds what prediction needs (training inputs, the solve ``alpha``,
hyperparameters, scaler): O(n d) numbers. The variance caches (the exact solver's n × n Cholesky
factor, the iterative solver's n × ``love_rank`` factor) are rebuilt on the first variance
request unless saved with ``store_variance_cache=True``.

Supported: :class:`scalegp.ScalableGPRegressor`, :class:`scalegp.ScalableGPClassifier`,
scikit-learn's ``StandardScaler``, and a ``Pipeline`` of StandardScalers ending in one of them.
A classifier's file holds its labels (numbers, booleans or text; sorted and distinct), its
training inputs and, per binary problem, the log-hyperparameters (in the units it was fitted
in: X's over a power of two, stored with them; files without it hold X's own), the mode, the
prediction vector and the variance factor (n × n for the exact solver, n × k for the
matrix-free one): what ``predict_proba`` needs, so it predicts exactly as before; its
``kernel_`` and compiled kernel are rebuilt from ``kernel`` and those hyperparameters. ``load_model(path,
expect="classifier")`` (or ``"regressor"``) refuses a file of the other kind.

A GP's scikit-learn ``kernel`` and fitted ``kernel_`` are JSON trees of allow-listed kernel
classes (ConstantKernel, RBF, Matern with ν 0.5/1.5/2.5, RationalQuadratic, ExpSineSquared,
WhiteKernel, Sum, Product) with their values, bounds and ν, each checked before a kernel is
built (:mod:`scalegp.persistence._kernels`); the kernel's compiled form is rebuilt at load.

Format versions: files are written as :data:`FORMAT_VERSION` (8: the classifier's units,
``_scale``; 7: the regressor's
``full_data_tol``, its ``log_marginal_likelihood_value_`` absent where the fit did not evaluate
it; 6: ScalableGPClassifier; 5: ``prune`` and ``prune_tol``; 4: ``n_targets``,
``copy_X_train`` and a per-point ``alpha``); older files load with the defaults of what they
lack: classifiers of version 6 and 7 in X's own units, version 4 files with the pruning defaults, version 3 files (kernels) with those of
version 4 too, and version 2 files (the default RBF model only) as ``kernel=None`` models. An older
scalegp refuses a newer file with a message naming its version.
"""

from scalegp.persistence._files import load_model, save_model
from scalegp.persistence._schema import FORMAT, FORMAT_VERSION, READ_VERSIONS
from scalegp.persistence._values import ModelFileError

# FORMAT, FORMAT_VERSION and READ_VERSIONS stay readable here (the docstring names them) but are
# not user API: nothing outside this package uses them.
__all__ = ["ModelFileError", "load_model", "save_model"]
