"""Shared helpers of the model-file tests: data, and editing a saved file as a hand edit would
(optionally with a recomputed checksum, which proves nothing)."""

import io
import json

import numpy as np

from scalegp.persistence import save_model
from scalegp.persistence._files import _digest
from scalegp.persistence._schema import HEADER_KEY

HEADER = HEADER_KEY


def data(n=60, d=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * np.arange(1, d + 1) + 5.0
    y = np.sin(x[:, 0]) + 0.1 * rng.normal(size=n)
    return x, y


def wave(n=40, d=1, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 5, size=(n, d))
    y = np.sin(2 * x[:, 0]) + 0.3 * x[:, -1] + 0.1 * rng.normal(size=n)
    return x, y


def rewrite(path, edit):
    """Rewrites a model file after ``edit(header, arrays)``, like a hand edit would."""
    with np.load(path, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    header = json.loads(str(arrays.pop(HEADER)[()]))
    edit(header, arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **{HEADER: np.array(json.dumps(header))}, **arrays)
    path.write_bytes(buffer.getvalue())


def resign(header, arrays):
    header["checksum"] = _digest(header, arrays).hex()


# ---------------------------------------------------------------------------------------------
# hostile files: a valid checksum proves nothing, every one must be a ModelFileError


def crafted(pipeline, tmp_path, edit):
    path = save_model(pipeline, tmp_path / "m.npz", store_variance_cache=True)

    def edit_and_resign(header, arrays):
        edit(header, arrays)
        resign(header, arrays)

    rewrite(path, edit_and_resign)
    return path


def gp_description(header):
    return header["model"]["steps"][1]["estimator"]


def nest(depth):
    node = {"class": "RBF", "length_scale": 1.0, "length_scale_bounds": "fixed"}
    for _ in range(depth):
        node = {"class": "Product", "k1": node, "k2": {"class": "ConstantKernel",
                                                       "constant_value": 1.0,
                                                       "constant_value_bounds": "fixed"}}
    return node
