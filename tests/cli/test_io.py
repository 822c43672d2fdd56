import numpy as np
import pytest

from scalegp.cli.common import CLIError
from scalegp.cli.io import Outputs, apply_missing_policy, check_output, encode_table, read_table


def write(path, text):
    path.write_text(text)
    return path


def test_csv_with_header_columns_and_delimiters(tmp_path):
    comma = write(tmp_path / "a.csv", "x,y,label\n1,2,cat\n3,4,dog\n")
    table = read_table(comma, columns=["y", "0"])
    assert table.columns == ["y", "x"]
    np.testing.assert_array_equal(table.values, [[2, 1], [4, 3]])

    semicolon = write(tmp_path / "b.csv", "x;y\n1.5;2\n3;4e-3\n")
    np.testing.assert_array_equal(read_table(semicolon).values, [[1.5, 2], [3, 4e-3]])
    tabs = write(tmp_path / "c.tsv", "x\ty\n1\t2\n")
    assert read_table(tabs).columns == ["x", "y"]
    explicit = write(tmp_path / "d.csv", "x|y\n1|2\n")
    assert read_table(explicit, delimiter="|").values.tolist() == [[1, 2]]


@pytest.mark.parametrize("text", [
    "x,y\n1,2\n3.25,-4e-3\n",
    "x,y\r\n1,2\r\n\r\n 3.25 , -4e-3\r\n",  # CRLF, a blank line, spaces around cells
    'x;"y"\n"1";2\n3.25;1e300\n',  # quoted cells, semicolons
])
def test_plain_numbers_take_the_fast_reader_with_the_careful_readers_values(tmp_path, text,
                                                                            monkeypatch):
    """A header and plain numbers: numpy's C reader (`_plain_numbers`), never the careful
    row-by-row reader, and the same values and column names as that reader gives."""
    import scalegp.cli.io as io_module

    path = write(tmp_path / "plain.csv", "")
    path.write_bytes(text.encode())
    careful = io_module._csv_rows

    def forbidden(*args, **kwargs):
        raise AssertionError("the careful reader ran")

    monkeypatch.setattr(io_module, "_csv_rows", forbidden)
    fast = read_table(path)
    monkeypatch.setattr(io_module, "_plain_numbers", lambda *args: None)
    monkeypatch.setattr(io_module, "_csv_rows", careful)
    slow = read_table(path)
    assert fast.columns == slow.columns
    np.testing.assert_array_equal(fast.values, slow.values)


def test_missing_values_error_or_drop(tmp_path):
    path = write(tmp_path / "m.csv", "x,y\n1,2\n,3\n4,NA\n5,6\n")
    with pytest.raises(CLIError, match=r"2 of 4 rows have missing values.*--missing drop"):
        read_table(path)
    table = read_table(path, missing="drop")
    assert table.values.tolist() == [[1, 2], [5, 6]] and table.dropped == 2
    # only the selected columns count
    assert read_table(path, columns=["x"], missing="drop").values.ravel().tolist() == [1, 4, 5]


def test_non_numeric_column_names_it_and_the_fix(tmp_path):
    path = write(tmp_path / "n.csv", "x,name\n1,alice\n2,bob\n")
    with pytest.raises(CLIError, match=r"column 'name' is not numeric \(line 2: 'alice'\).*--columns"):
        read_table(path)
    assert read_table(path, columns=["x"]).values.ravel().tolist() == [1, 2]


def test_long_fields(tmp_path, monkeypatch):
    note = "x" * 200_000  # over the csv module's default limit of 131,072 characters
    path = write(tmp_path / "long.csv", f"x,note\n1,{note}\n2,short\n")
    assert read_table(path, columns=["x"]).values.ravel().tolist() == [1, 2]
    with pytest.raises(CLIError, match=r"column 'note' is not numeric \(line 2: 'xxxx"):
        read_table(path)
    monkeypatch.setattr("scalegp.cli.io.CSV_FIELD_LIMIT", 1000)
    with pytest.raises(CLIError, match=r"long.csv is not a readable CSV file \(field larger"):
        read_table(path, columns=["x"])


@pytest.mark.parametrize("content, message", [
    ("", "is empty"),
    ("1,2\n3,4\n", "needs a header line"),
    ("x,y\n", "has a header but no rows"),
    ("x,y\n1,2,3\n", "line 2: 3 fields, the header has 2"),
])
def test_malformed_csv(tmp_path, content, message):
    with pytest.raises(CLIError, match=message):
        read_table(write(tmp_path / "bad.csv", content))


def test_arrays_npy_npz_and_one_dimensional(tmp_path):
    np.save(tmp_path / "v.npy", np.arange(5.0))
    table = read_table(tmp_path / "v.npy")
    assert table.values.shape == (5, 1) and table.columns == ["0"]
    np.savez(tmp_path / "z.npz", a=np.ones((3, 2)), b=np.zeros(4, np.int32))
    with pytest.raises(CLIError, match="several arrays .*a, b.*--key"):
        read_table(tmp_path / "z.npz")
    assert read_table(tmp_path / "z.npz", key="b").values.shape == (4, 1)
    with pytest.raises(CLIError, match="no array 'c'; it holds a, b"):
        read_table(tmp_path / "z.npz", key="c")


@pytest.mark.parametrize("array, message", [
    (np.zeros((2, 3, 4)), "3 dimensions"),
    (np.zeros((0, 3)), "no values"),
    (np.array(["a", "b"]), "needs numbers"),
    (np.array([[1.0, np.inf]]), "infinite values"),
    (np.array([[1.0, np.nan]]), "missing values"),
])
def test_bad_arrays(tmp_path, array, message):
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(CLIError, match=message):
        read_table(tmp_path / "bad.npy")


def test_pickled_objects_are_refused(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(CLIError, match="Python objects"):
        read_table(tmp_path / "obj.npy")


def test_paths(tmp_path):
    with pytest.raises(CLIError, match="does not exist"):
        read_table(tmp_path / "nope.csv")
    with pytest.raises(CLIError, match="is a directory"):
        read_table(tmp_path)
    with pytest.raises(CLIError, match="suffix '.json'"):
        read_table(write(tmp_path / "a.json", "{}"))
    with pytest.raises(CLIError, match="no column 'z'; columns are x, y"):
        read_table(write(tmp_path / "c.csv", "x,y\n1,2\n"), columns=["z"])
    with pytest.raises(CLIError, match="--missing must be one of"):
        apply_missing_policy(read_table(tmp_path / "c.csv"), "ignore")


def test_check_output(tmp_path):
    source = write(tmp_path / "in.csv", "x\n1\n")
    existing = write(tmp_path / "old.npy", "")
    assert check_output(None, force=False, inputs=[source]) is None
    with pytest.raises(CLIError, match="is an input file"):
        check_output(source.with_suffix(".csv"), force=True, inputs=[source])
    with pytest.raises(CLIError, match="exists; pass --force"):
        check_output(existing, force=False, inputs=[source])
    assert check_output(existing, force=True, inputs=[source]) == existing
    with pytest.raises(CLIError, match="ending in .npy or .csv"):
        check_output(tmp_path / "out.txt", force=False, inputs=[])
    with pytest.raises(CLIError, match="does not exist"):
        check_output(tmp_path / "no" / "out.npy", force=False, inputs=[])


def test_tables_round_trip_and_no_temporary_files(tmp_path):
    values = np.random.default_rng(0).normal(size=(7, 2))
    outputs = Outputs(force=False, inputs=[])
    npy, csv = outputs.add(tmp_path / "o.npy"), outputs.add(tmp_path / "o.csv")
    outputs.publish({path: encode_table(values, ["a", "b"], path.suffix) for path in (npy, csv)})
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), values)
    back = read_table(tmp_path / "o.csv")
    assert back.columns == ["a", "b"]
    np.testing.assert_array_equal(back.values, values)  # %.17g round-trips float64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.csv", "o.npy"]  # no temp files


def test_an_interrupt_right_after_a_temporary_file_is_created_leaves_nothing(tmp_path,
                                                                             monkeypatch):
    # Ctrl-C between creating a temporary file and noting it for removal once left it behind
    from scalegp.cli import io

    outputs = Outputs(force=False, inputs=[])
    path = outputs.add(tmp_path / "o.npy")
    create = io._create

    def create_then_interrupt(target):
        create(target)
        raise KeyboardInterrupt

    monkeypatch.setattr(io, "_create", create_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        outputs.publish({path: b"data"})
    assert list(tmp_path.iterdir()) == []
