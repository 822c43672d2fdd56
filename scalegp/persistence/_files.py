"""Model files on disk: checksum and signature, atomic writes, and reading members after their
``.npy`` headers are checked."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import secrets
import zipfile
from pathlib import Path

import numpy as np

from scalegp import __version__
from scalegp.persistence._check import build, check_arrays, check_header
from scalegp.persistence._encode import encode
from scalegp.persistence._schema import (
    FORMAT,
    FORMAT_VERSION,
    HEADER_KEY,
    MAX_HEADER_CHARS,
    READ_VERSIONS,
)
from scalegp.persistence._values import ModelFileError


# ---------------------------------------------------------------------------------------------
# checksum, signature and file access


def _digest(header: dict, arrays: dict[str, np.ndarray]) -> bytes:
    content = {k: v for k, v in header.items() if k not in ("checksum", "signature")}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode())
    for key in sorted(arrays):
        value = np.ascontiguousarray(arrays[key])
        digest.update(f"{key}|{value.dtype.str}|{value.shape}|".encode())
        digest.update(value.tobytes())
    return digest.digest()


def _signature(key, digest: bytes) -> str:
    if isinstance(key, str):
        try:
            key = key.encode()
        except UnicodeEncodeError as error:  # e.g. os.environ's form of bytes that are not UTF-8
            raise ValueError(f"key must be a non-empty str or bytes; a str is used as its UTF-8 "
                             f"bytes, and this one has none (a lone surrogate at position "
                             f"{error.start}): pass the key as bytes") from None
    if not isinstance(key, bytes) or not key:
        raise ValueError(f"key must be a non-empty str or bytes, got {key!r}")
    return hmac.new(key, digest, hashlib.sha256).hexdigest()


def _check_fitted(model) -> None:
    """NotFittedError unless ``model`` (each step of a Pipeline) is fitted; by its
    ``n_features_in_``, which fit sets, since ``check_is_fitted`` alone passes an estimator that
    predicts before fit (``requires_fit=False``: ScalableGPRegressor's prior)."""
    from sklearn.pipeline import Pipeline
    from sklearn.utils.validation import check_is_fitted

    check_is_fitted(model)
    for estimator in [step for _, step in model.steps] if isinstance(model, Pipeline) else [model]:
        if hasattr(estimator, "fit"):
            check_is_fitted(estimator, "n_features_in_")


def save_model(model, path, *, metadata: dict | None = None, key: str | bytes | None = None,
               store_variance_cache: bool = False) -> Path:
    """Writes a fitted model to ``path`` (``.npz``), atomically (temporary file, then rename).

    Parameters
    ----------
    model : ScalableGPRegressor, ScalableGPClassifier, StandardScaler or a Pipeline of
        StandardScalers ending in one of them, fitted.
    path : str or Path
    metadata : dict, optional
        JSON-serialisable extras stored in the header, e.g. ``{"features": [...]}``;
        :func:`load_model` returns them with ``return_metadata=True``.
    key : str or bytes, optional
        Signs the file (HMAC-SHA256) so that :func:`load_model` with the same key detects any
        edit; keep the key secret. Without it the file has a checksum only, which detects
        corruption but not tampering.
    store_variance_cache : bool, default=False
        Also store the GP's variance factor (the exact solver's n × n Cholesky factor, the
        iterative solver's n × ``love_rank`` factor, if built). Off, the file holds O(n d)
        numbers and the factor is rebuilt on the first ``return_std``/``return_cov``.

    Returns
    -------
    Path written.
    """
    _check_fitted(model)
    path = Path(path)
    arrays: dict[str, np.ndarray] = {}
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "scalegp_version": __version__,
        "model": encode(model, "", arrays, store_variance_cache),
        "metadata": json.loads(json.dumps(metadata or {})),
        "checksum": "0" * 64,  # left out of the digest
    }
    # The loader's checks, here too: a file written is a file that loads.
    try:
        plan, _ = check_header(header, "header")
        check_arrays(plan, arrays, "model")
    except ModelFileError as error:
        raise ValueError(f"cannot save this model: {error}") from None
    size = len(json.dumps(header))
    if size > MAX_HEADER_CHARS:  # the loader reads no more
        raise ValueError(
            f"cannot save this model: its header would take {size} characters, more than "
            f"the {MAX_HEADER_CHARS} a model file may (a per-point alpha is stored there, in "
            "the parameters; so are the metadata)")
    digest = _digest(header, arrays)
    header["checksum"] = digest.hex()
    if key is not None:
        header["signature"] = _signature(key, digest)
    buffer = io.BytesIO()
    np.savez(buffer, **{HEADER_KEY: np.array(json.dumps(header))}, **arrays)
    atomic_write_bytes(path, buffer.getvalue())
    return path


#: ``load_model(expect=...)``: what the model (a Pipeline's last step) must be.
EXPECT = ("classifier", "regressor")


def load_model(path, *, return_metadata: bool = False, key: str | bytes | None = None,
               expect: str | None = None):
    """Reads a model written by :func:`save_model`; never unpickles.

    Parameters
    ----------
    path : str or Path
    return_metadata : bool, default=False
        Also return the metadata dict given to :func:`save_model`.
    key : str or bytes, optional
        The key the file was signed with. With a key, an unsigned file or one signed with
        another key is refused; without one, a signed file is refused.
    expect : {"classifier", "regressor"}, optional
        Refuse a file whose model (a Pipeline's last step) is not of this kind, e.g. a
        ScalableGPRegressor where a ScalableGPClassifier is expected, before reading its arrays.

    Raises
    ------
    ModelFileError
        Not a scalegp model file, an unsupported format version, a header or array that breaks
        the schema, a checksum mismatch (corrupt), a missing or wrong signature, a model not
        of the kind ``expect`` names.
    """
    path = Path(path)
    if expect is not None and expect not in EXPECT:
        raise ValueError(f"expect must be one of {', '.join(map(repr, EXPECT))} or None, got "
                         f"{expect!r}")
    if key is not None:
        _signature(key, b"")  # a bad key is the caller's error, before reading anything
    try:
        with open(path, "rb") as f:
            if f.read(6) == np.lib.format.MAGIC_PREFIX:
                raise ModelFileError(f"{path} holds a single array, not a scalegp model file")
        with zipfile.ZipFile(path) as archive:
            members = {info.filename: info for info in archive.infolist()}
            if len(members) != len(archive.infolist()):
                raise ModelFileError(f"{path} has duplicated members")
            if f"{HEADER_KEY}.npy" not in members:
                raise ModelFileError(f"{path} is not a scalegp model file (no header)")
            raw = _read_member(archive, members[f"{HEADER_KEY}.npy"], None, path)
            header = _parse_header(raw[()], path)
            plan, declared = _with_path(path, check_header, header, "header")
            _check_kind(plan, expect, path)
            extra = sorted(set(members) - {f"{k}.npy" for k in declared}
                           - {f"{HEADER_KEY}.npy"})
            if extra:
                raise ModelFileError(f"{path} has members the header does not declare: "
                                     f"{', '.join(extra[:5])}")
            arrays = {}
            for archive_key, (shape, dtype) in declared.items():
                if f"{archive_key}.npy" not in members:
                    raise ModelFileError(f"{path}: array {archive_key!r} is missing")
                arrays[archive_key] = _read_member(archive, members[f"{archive_key}.npy"],
                                                   (shape, dtype), path)
    except (FileNotFoundError, IsADirectoryError, PermissionError, ModelFileError):
        raise
    except MemoryError:
        raise ModelFileError(f"{path}: not enough memory to load this model") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as error:
        raise ModelFileError(f"{path} is not a readable model file ({error})") from None
    digest = _digest(header, arrays)
    if not hmac.compare_digest(header["checksum"], digest.hex()):
        raise ModelFileError(f"{path}: checksum mismatch, the file is corrupt or was modified; "
                             "refit the model or restore the original file")
    _check_signature(header, digest, key, path)
    _with_path(path, check_arrays, plan, arrays, "model")
    model = build(plan, arrays)
    return (model, header["metadata"]) if return_metadata else model


def _check_kind(plan, expect: str | None, path) -> None:
    """A ModelFileError unless the model ``plan`` builds (its last step) is an ``expect``."""
    from sklearn.base import ClassifierMixin, RegressorMixin

    if expect is None:
        return
    final = plan.steps[-1][1] if plan.steps else plan
    if issubclass(final.cls, {"classifier": ClassifierMixin, "regressor": RegressorMixin}[expect]):
        return
    where = " (the last step of a Pipeline)" if plan.steps else ""
    raise ModelFileError(f"{path} holds a {final.cls.__name__}{where}, not a {expect}; give a "
                         f"file saved from a {expect}")


def _with_path(path, check, *args):
    try:
        return check(*args)
    except ModelFileError as error:
        raise ModelFileError(f"{path}: {error}") from None


def _check_signature(header: dict, digest: bytes, key, path) -> None:
    signature = header.get("signature")
    if key is None and signature is not None:
        raise ModelFileError(f"{path} is signed; load it with its key (key=..., or the "
                             "SCALEGP_MODEL_KEY environment variable for the command line)")
    if key is not None and signature is None:
        raise ModelFileError(f"{path} is not signed, but a key was given: it may have been "
                             "edited; sign it (save_model(..., key=...)) or load it without a key")
    if key is not None and not hmac.compare_digest(signature, _signature(key, digest)):
        raise ModelFileError(f"{path}: the signature does not match this key: the file was "
                             "modified or signed with another key")


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, declared, path) -> np.ndarray:
    """One ``.npy`` member; its header is checked against ``declared`` (shape, dtype), or for
    the JSON header against the size cap, before its data are read, and its data must fill it
    exactly: memory never exceeds what the file holds."""
    where = f"{path}: member {info.filename!r}"
    if info.compress_type != zipfile.ZIP_STORED:
        raise ModelFileError(f"{where} is compressed; scalegp model files store arrays as is")
    with archive.open(info) as f:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ModelFileError(f"{where} has .npy format version {version}, expected 1.0 "
                                 "or 2.0")
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran_order, dtype = read_header(f)
        if declared is None:  # the JSON header: one string
            if shape != () or dtype.kind != "U" or dtype.itemsize > 4 * MAX_HEADER_CHARS:
                raise ModelFileError(f"{where}: expected one string of at most "
                                     f"{MAX_HEADER_CHARS} characters, got {dtype} {shape}")
        elif (shape, dtype) != declared or fortran_order:
            raise ModelFileError(f"{where} holds {dtype.str} {shape}"
                                 f"{' (Fortran order)' if fortran_order else ''}; the header "
                                 f"declares {declared[1].str} {declared[0]}")
        nbytes = dtype.itemsize * int(np.prod(shape, dtype=object))  # no overflow
        if info.file_size != f.tell() + nbytes:
            raise ModelFileError(f"{where} has {info.file_size - f.tell()} bytes of data, "
                                 f"{dtype.str} {shape} needs {nbytes}")
        array = np.empty(shape, dtype)
        view, filled = memoryview(array.reshape(-1).view(np.uint8)), 0
        while filled < nbytes:
            count = f.readinto(view[filled:])
            if not count:
                raise ModelFileError(f"{where} is truncated")
            filled += count
    return array


def _parse_header(text, path) -> dict:
    try:
        header = json.loads(str(text))
    except RecursionError:
        raise ModelFileError(f"{path}: the header is nested too deeply") from None
    except json.JSONDecodeError as error:
        raise ModelFileError(f"{path}: the header is not valid JSON ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a scalegp model file")
    version = header.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        readable = " and ".join(map(str, READ_VERSIONS))
        raise ModelFileError(f"{path} has model format version {version!r:.40}; this scalegp "
                             f"reads versions {readable}: refit, or use the scalegp version "
                             f"that wrote it ({header.get('scalegp_version')!r:.40})")
    return header


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes via a temporary file in the same folder and a rename, so a reader never sees a
    half-written file and a failure leaves any previous file untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name[:100]}.{secrets.token_hex(8)}.tmp")
    try:
        # created once named, so that an interrupt right after its creation still removes it
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
