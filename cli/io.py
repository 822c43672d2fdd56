"""Reading tables (.npy, .npz, .csv) and writing results safely.

Every problem with a file becomes a :class:`~scalegp.cli.common.CLIError` that names the file and
the fix. Arrays load with ``allow_pickle=False``. Outputs are checked before any work starts (not
an input, not an existing file without ``--force``, a known suffix, a folder that takes a new
file) and published together at the end (:class:`Outputs`).
"""

from __future__ import annotations

import csv
import io
import os
import secrets
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import typer

from .common import CLIError
from .interrupts import guarded, note_files, raise_if_interrupted

TABLE_SUFFIXES = (".npy", ".npz", ".csv", ".tsv", ".txt")
OUTPUT_SUFFIXES = (".npy", ".csv")
MISSING_POLICIES = ("error", "drop")
#: Cells read as missing in a CSV file.
MISSING_TOKENS = frozenset({"", "na", "nan", "n/a", "null", "none", "?", "-"})
#: Longest CSV field, in characters. The csv module's default (131,072) guards streaming readers;
#: here the whole file is in memory already, so a long text field (a note, a JSON blob) in a
#: column left unused is no reason to fail. The largest value every platform's C long holds.
CSV_FIELD_LIMIT = 2**31 - 1


@dataclass
class Table:
    """A numeric table read from a file.

    values: (n, d) float64, finite. columns: d names (the CSV header; "0", "1", ... for arrays).
    dropped: rows skipped for missing values (``missing="drop"``).
    """

    values: np.ndarray
    columns: list[str]
    path: Path
    dropped: int = 0

    def column_subset(self, names: list[str]) -> "Table":
        index = [_column_index(name, self.columns, self.path) for name in names]
        return Table(self.values[:, index], [self.columns[i] for i in index], self.path,
                     self.dropped)


def _column_index(name: str, columns: list[str], path: Path) -> int:
    if name in columns:
        return columns.index(name)
    if name.lstrip("-").isdigit():
        index = int(name)
        if -len(columns) <= index < len(columns):
            return index % len(columns)
    shown = ", ".join(columns[:12]) + (", ..." if len(columns) > 12 else "")
    raise CLIError(f"{path}: no column {name!r}; columns are {shown} (names, or indices from 0)")


def _check_input_path(path: Path, what: str) -> None:
    if not path.exists():
        raise CLIError(f"{what} file {str(path)!r} does not exist; check the path")
    if path.is_dir():
        raise CLIError(f"{what} {str(path)!r} is a directory; give a .npy, .npz or .csv file")
    if path.stat().st_size == 0:
        raise CLIError(f"{what} file {str(path)!r} is empty")
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise CLIError(f"{what} file {str(path)!r} has suffix {path.suffix!r}; scalegp reads "
                       f"{', '.join(TABLE_SUFFIXES)}")


def read_table(
    path: str | Path,
    *,
    what: str = "data",
    key: str | None = None,
    columns: list[str] | None = None,
    delimiter: str | None = None,
    missing: str | None = "error",
    columns_option: str = "--columns",
) -> Table:
    """Reads a numeric table: rows are points, columns are features.

    A 1-D array is n points in one dimension. ``columns`` selects columns by name (CSV header)
    or index. Missing values (NaN, or the CSV tokens in ``MISSING_TOKENS``) in the selected
    columns raise unless ``missing="drop"``; infinite values always raise. ``missing=None``
    leaves them for the caller to settle with :func:`apply_missing_policy` after choosing
    columns.
    """
    path = Path(path)
    _check_input_path(path, what)
    if missing is not None and missing not in MISSING_POLICIES:
        raise CLIError(f"--missing must be one of {', '.join(MISSING_POLICIES)}, got {missing!r}")
    suffix = path.suffix.lower()
    if suffix in (".npy", ".npz"):
        table = _read_array(path, key, what)
    else:
        table = _read_csv(path, delimiter, columns, what, columns_option)
    if columns is not None:
        table = table.column_subset(columns)
    return table if missing is None else apply_missing_policy(table, missing)


def _read_array(path: Path, key: str | None, what: str) -> Table:
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            if key is not None:
                raise CLIError(f"--key is for .npz archives; {path} is a single array")
            array = loaded
        else:
            with loaded as archive:
                names = list(archive.files)
                if not names:
                    raise CLIError(f"{what} file {path} is an empty .npz archive")
                if key is None and len(names) > 1:
                    raise CLIError(f"{path} holds several arrays ({', '.join(names)}); choose "
                                   "one with --key")
                chosen = key if key is not None else names[0]
                if chosen not in names:
                    raise CLIError(f"{path} has no array {chosen!r}; it holds "
                                   f"{', '.join(names)}")
                array = archive[chosen]
    except CLIError:
        raise
    except ValueError as error:
        if "pickle" in str(error):
            raise CLIError(f"{path} holds Python objects, which scalegp does not load (they can "
                           "run code); save a numeric array instead") from None
        raise CLIError(f"cannot read {path}: {error}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as error:
        raise CLIError(f"cannot read {path} ({error}); is it a NumPy file?") from None
    if array.dtype.names is not None or array.dtype.kind not in "biuf":
        raise CLIError(f"{path} has dtype {array.dtype}; scalegp needs numbers (int or float)")
    if array.ndim == 0 or array.ndim > 2:
        raise CLIError(f"{path} has {array.ndim} dimensions, shape {array.shape}; expected a "
                       "table of shape (points, features) or a 1-D array of points")
    if array.ndim == 1:
        array = array[:, None]
    if array.size == 0:
        raise CLIError(f"{what} file {path} has no values (shape {array.shape})")
    return Table(array.astype(np.float64), [str(i) for i in range(array.shape[1])], path)


def _sniff_delimiter(path: Path, first_line: str) -> str:
    if path.suffix.lower() == ".tsv":
        return "\t"
    counts = {d: first_line.count(d) for d in (",", "\t", ";")}
    best = max(counts, key=counts.get)
    if counts[best]:
        return best
    return "," if path.suffix.lower() == ".csv" else " "


def _csv_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise CLIError(f"{path} is not a UTF-8 text file; a binary file needs the .npy or .npz "
                       "suffix") from None


def _resolved_delimiter(path: Path, first_line: str, delimiter: str | None) -> str:
    if delimiter is None:
        return _sniff_delimiter(path, first_line)
    return "\t" if delimiter in ("\\t", "tab") else delimiter


def _csv_rows(path: Path, delimiter: str | None, what: str, text: str | None = None):
    """A CSV file's header (stripped names), its non-blank rows as (line number, fields) and
    the delimiter used (``text``: the file's, read already)."""
    text = _csv_text(path) if text is None else text
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise CLIError(f"{what} file {path} has no header line")
    delimiter = _resolved_delimiter(path, lines[0], delimiter)
    csv.field_size_limit(CSV_FIELD_LIMIT)
    try:
        rows = list(csv.reader(io.StringIO(text), delimiter=delimiter,
                               skipinitialspace=delimiter == " "))
    except csv.Error as error:
        raise CLIError(f"{path} is not a readable CSV file ({error})") from None
    header = [name.strip() for name in rows[0]]
    if all(_is_number(name) for name in header):
        raise CLIError(f"{path}: the first line ({lines[0][:60]!r}) looks like data; a .csv file "
                       "needs a header line with column names")
    width = len(header)
    # (line number, fields) of the non-blank rows, in one pass with the width check.
    body = []
    for number, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != width:
            raise CLIError(f"{path}, line {number}: {len(row)} fields, the header has {width}; "
                           f"check the delimiter (now {delimiter!r}, set it with --delimiter)")
        body.append((number, row))
    if not body:
        raise CLIError(f"{what} file {path} has a header but no rows")
    return header, body, delimiter


def _plain_numbers(path: Path, text: str, delimiter: str | None) -> Table | None:
    """A CSV file (its ``text``) of a header and plain numbers only, read by numpy's C parser
    (far faster than the careful reader: docs/decisions.md #53), or None: the file has
    something else (a missing token, text, a ragged row, a space delimiter, no rows), which the
    careful reader (`_csv_rows`) parses, or names."""
    first = text.partition("\n")[0]
    delimiter = _resolved_delimiter(path, first, delimiter)
    if delimiter == " " or not first.strip():
        return None
    header = [name.strip() for name in next(csv.reader([first], delimiter=delimiter))]
    if all(_is_number(name) for name in header):
        return None
    try:
        values = np.loadtxt(io.StringIO(text), delimiter=delimiter, skiprows=1, ndmin=2,
                            dtype=np.float64, comments=None, quotechar='"')
    except ValueError:
        return None
    if values.shape[0] == 0 or values.shape[1] != len(header):
        return None
    return Table(values, header, path)


def _read_csv(path: Path, delimiter: str | None, columns: list[str] | None, what: str,
              columns_option: str) -> Table:
    text = _csv_text(path)
    plain = _plain_numbers(path, text, delimiter)
    if plain is not None:
        for name in columns or ():
            _column_index(name, plain.columns, path)
        return plain
    header, body, delimiter = _csv_rows(path, delimiter, what, text)
    width = len(header)
    wanted = range(width) if columns is None else [
        _column_index(name, header, path) for name in columns]
    values = np.full((len(body), width), np.nan)
    for j in dict.fromkeys(wanted):
        for i, (number, row) in enumerate(body):
            cell = row[j].strip()
            if cell.lower() in MISSING_TOKENS:
                continue
            try:
                values[i, j] = float(cell)
            except ValueError:
                raise CLIError(
                    f"{path}: column {header[j]!r} is not numeric (line {number}: "
                    f"{cell[:40]!r}); choose numeric columns with {columns_option}"
                ) from None
    return Table(values, header, path)


def read_header(path: str | Path, *, what: str = "data", delimiter: str | None = None) -> list[str]:
    """The column names of a CSV file (its header line, checked as :func:`read_table` does)."""
    path = Path(path)
    _check_input_path(path, what)
    return _csv_rows(path, delimiter, what)[0]


def read_labels(path: str | Path, column: str, *, what: str = "data", key: str | None = None,
                delimiter: str | None = None):
    """The cells of one column as they are written, for class labels that may be text:
    ``(labels, missing, name, columns)``: the labels (n,) (str for a CSV, float64 for an
    array), which of them are missing (``MISSING_TOKENS`` or NaN), the column's name and all the
    file's column names. Rows are those :func:`read_table` reads, in its order."""
    path = Path(path)
    _check_input_path(path, what)
    if path.suffix.lower() in (".npy", ".npz"):
        table = _read_array(path, key, what)
        chosen = table.column_subset([column])
        labels = chosen.values[:, 0]
        return labels, np.isnan(labels), chosen.columns[0], table.columns
    header, body, _ = _csv_rows(path, delimiter, what)
    j = _column_index(column, header, path)
    labels = np.array([row[j].strip() for _, row in body], dtype=str)
    missing = np.array([cell.lower() in MISSING_TOKENS for cell in labels.tolist()], dtype=bool)
    return labels, missing, header[j], header


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def apply_missing_policy(table: Table, missing: str) -> Table:
    """Raises on infinite values; on missing (NaN) ones too, or drops their rows."""
    if missing not in MISSING_POLICIES:
        raise CLIError(f"--missing must be one of {', '.join(MISSING_POLICIES)}, got {missing!r}")
    values = table.values
    if np.isinf(values).any():
        row = int(np.argmax(np.isinf(values).any(axis=1)))
        raise CLIError(f"{table.path}: infinite values (first in row {row}); remove or replace "
                       "them")
    bad = np.isnan(values).any(axis=1)
    if bad.any():
        if missing == "error":
            raise CLIError(
                f"{table.path}: {int(bad.sum())} of {len(values)} rows have missing values "
                f"(first: row {int(np.argmax(bad))}, counting data rows from 0); pass "
                "--missing drop to skip them"
            )
        values = values[~bad]
        if len(values) == 0:
            raise CLIError(f"{table.path}: every row has a missing value; nothing is left")
    return Table(values, table.columns, table.path, table.dropped + int(bad.sum()))


# ---------------------------------------------------------------------------------------------
# outputs


def check_output(path: str | Path | None, *, force: bool, inputs: list[Path],
                 suffixes: tuple[str, ...] = OUTPUT_SUFFIXES, option: str = "--out") -> Path | None:
    """Validates an output path before any work: known suffix, a folder that takes a new file
    (tried, so it holds for root and read-only mounts too), not one of the inputs, not an
    existing file unless ``force``."""
    if path is None:
        return None
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        raise CLIError(f"{option} {str(path)!r}: use a file name ending in {' or '.join(suffixes)}")
    folder = path.parent
    if not folder.is_dir():
        problem = "is not a folder" if folder.exists() else "does not exist"
        raise CLIError(f"{option} {str(path)!r}: folder {str(folder)!r} {problem}")
    # A probe file with a name as long as the destination's, so that a name too long fails here
    # too, before anything else looks at it.
    length = len(os.fsencode(path.name))
    probe = path.with_name(("." + secrets.token_hex(max(length, 16)))[:max(length, 17)])
    note_files(probe)  # a random name, removed on an interrupt even right after its creation
    try:
        _create(probe).unlink()
    except OSError as error:
        raise CLIError(f"{option} {str(path)!r}: cannot create a file in folder {str(folder)!r} "
                       f"({error.strerror or error})") from None
    if path.is_dir():
        raise CLIError(f"{option} {str(path)!r} is a directory; give a file name")
    for source in inputs:
        if path.resolve() == Path(source).resolve():
            raise CLIError(f"{option} {str(path)!r} is an input file; choose another name")
    if path.exists() and not force:
        raise CLIError(_exists(option, path))
    return path


def _exists(option: str, path: Path) -> str:
    return f"{option} {str(path)!r} exists; pass --force to overwrite it"


def _create(path: Path) -> Path:
    """Creates an empty file that must not exist yet, with the usual permissions (umask)."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return path


class Outputs:
    """The files one command writes, published together.

    :meth:`add` checks a destination before any work (:func:`check_output`). :meth:`publish`
    writes every file to a temporary file beside its destination and only when all are written
    puts them in place: exclusively unless ``force``, so a file that another run wrote meanwhile
    is an "exists" error instead of being silently replaced. A failure or an interrupt (Ctrl-C,
    SIGTERM) leaves none of the files and no temporary ones: every file is noted for the
    command's interrupted exit (`.interrupts`), which removes even outputs already in place, and
    an interrupt that was lost (in a gc callback) stops the placing.
    """

    def __init__(self, *, force: bool, inputs: list[Path]):
        self.force = force
        self.inputs = inputs
        self.options: dict[Path, str] = {}  # destination -> its option, for messages

    def add(self, path: str | Path | None, option: str = "--out",
            suffixes: tuple[str, ...] = OUTPUT_SUFFIXES) -> Path | None:
        path = check_output(path, force=self.force, inputs=self.inputs, suffixes=suffixes,
                            option=option)
        if path is None:
            return None
        for other, other_option in self.options.items():
            if path.resolve() == other.resolve():
                raise CLIError(f"{other_option} and {option} are the same file {str(path)!r}; "
                               "give different files")
        self.options[path] = option
        return path

    def publish(self, files: dict[Path, bytes | Callable[[Path], object]]) -> None:
        """Writes ``files`` (destination -> its bytes, or a function that writes the file at the
        path it is given, e.g. ``save_model``) and puts them in place, all or none."""
        staged: list[Path] = []
        placed: list[Path] = []
        try:
            for dest, content in files.items():
                temporary = dest.with_name(f".{dest.name[:100]}.{secrets.token_hex(8)}.tmp")
                # noted before it exists, so that an interrupt right after its creation
                # still removes it (the cleanup skips a name never created)
                staged.append(temporary)
                note_files(temporary)
                _create(temporary)
                if isinstance(content, bytes):
                    temporary.write_bytes(content)
                else:
                    content(temporary)
            for temporary, dest in zip(staged, files):
                with guarded():  # placed and noted, or neither, when a forced exit looks
                    raise_if_interrupted()
                    try:
                        self._place(temporary, dest, placed)
                    finally:
                        note_files(*placed)
        except BaseException:
            for dest in placed:
                dest.unlink(missing_ok=True)
            raise
        finally:
            for temporary in staged:
                temporary.unlink(missing_ok=True)

    def _place(self, temporary: Path, dest: Path, placed: list[Path]) -> None:
        """Moves ``temporary`` to ``dest``, which joins ``placed`` as soon as it is ours."""
        if self.force:
            os.replace(temporary, dest)
            placed.append(dest)
            return
        try:
            os.link(temporary, dest)  # fails if dest exists, unlike a rename
            placed.append(dest)
            return
        except FileExistsError:
            raise CLIError(_exists(self.options[dest], dest)) from None
        except OSError:
            pass  # no hard links here (FAT, some network file systems)
        try:
            _create(dest)  # claims the name exclusively; then the file moves in
        except FileExistsError:
            raise CLIError(_exists(self.options[dest], dest)) from None
        placed.append(dest)
        os.replace(temporary, dest)


def encode_table(values: np.ndarray, columns: list[str], suffix: str) -> bytes:
    """(n,) or (n, k) values as the bytes of a .npy file, or of a .csv file with a header."""
    values = np.asarray(values)
    buffer = io.BytesIO()
    if suffix.lower() == ".npy":
        np.save(buffer, values.astype(str) if values.dtype.kind == "O" else values,
                allow_pickle=False)
        return buffer.getvalue()
    table = values.reshape(len(values), -1)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")  # quotes names and labels with commas
    writer.writerow(columns)
    if table.dtype.kind in "fc":
        buffer.write(text.getvalue().encode())
        np.savetxt(buffer, table, delimiter=",", fmt="%.17g")
        return buffer.getvalue()
    writer.writerows(table.tolist())  # labels: integers, booleans or text
    return text.getvalue().encode()


def print_table(names: list[str], values: np.ndarray) -> None:
    """Values (n, k) as CSV on stdout, with a header: numbers to 9 digits, labels as written
    (quoted if need be)."""
    def line(cells) -> str:
        text = io.StringIO()
        csv.writer(text, lineterminator="").writerow(cells)
        return text.getvalue()

    raise_if_interrupted()  # a lost interrupt prints nothing (`.interrupts`)
    number = values.dtype.kind == "f"  # integer labels print whole, whatever their size
    typer.echo(line(names))
    for row in values:
        typer.echo(line([f"{v:.9g}" for v in row] if number else [str(v) for v in row]))
