"""The repository's structure rules (tools/check_structure.py) hold, and the checker catches what
it claims to: each rule is tried on a small made-up package."""

import importlib.util
import textwrap
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "check_structure.py"
_spec = importlib.util.spec_from_file_location("check_structure", _PATH)
check_structure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_structure)


def test_repository_keeps_its_structure_rules():
    problems = check_structure.problems()
    assert not problems, "\n".join(problems)


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, source in files.items():
        path = root / "scalegp" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return {"scalegp": root / "scalegp"}


def _found(tmp_path, files):
    sources = _package(tmp_path, {"__init__.py": "", "ops/__init__.py": "", **files})
    return check_structure.problems(root=tmp_path, sources=sources)


def _kinds(problems):
    return {problem.split(":")[0] for problem in problems if not problem.startswith("tests:")}


def test_clean_package_passes(tmp_path):
    files = {"ops/_a.py": "from scalegp.ops._b import value\n", "ops/_b.py": "value = 1\n",
             "kde/__init__.py": "from scalegp.ops import _a\n"}
    assert _kinds(_found(tmp_path, files)) == {"private"}  # kde takes ops' private module
    files["kde/__init__.py"] = "from scalegp.ops import value\n"
    files["ops/__init__.py"] = "from scalegp.ops._b import value\n"
    assert _kinds(_found(tmp_path, files)) == set()


@pytest.mark.parametrize("files, kind", [
    ({"ops/_a.py": "from scalegp.ops._b import x\n", "ops/_b.py": "from scalegp.ops._a import y\n"},
     "cycle"),
    ({"ops/_a.py": "x = 1\n", "ops/_b.py": "def f():\n    from scalegp.ops._a import x\n    return x\n"},
     "nested"),
    ({"ops/_a.py": "_x = 1\n", "ops/_b.py": "from ._a import _x\n"}, "private"),
    ({"ops/_a.py": "x = 1\n", "kde/_b.py": "from scalegp.ops._a import x\n"}, "private"),
    ({"ops/_a.py": "x = 1\n" * 551}, "size"),
    ({"ops/_a.py": "def f():\n" + "    x = 1\n" * 91 + "    return x\n"}, "function"),
])
def test_each_rule_is_caught(tmp_path, files, kind):
    assert kind in _kinds(_found(tmp_path, files))


def test_docstrings_and_comments_are_not_code_lines(tmp_path):
    body = '    """' + "doc\n" * 100 + '    """\n' + "    # why\n" * 100 + "    return 1\n"
    assert _kinds(_found(tmp_path, {"ops/_a.py": "def f():\n" + body})) == set()


def test_library_wide_private_module_is_usable_below_it(tmp_path):
    files = {"_validation.py": "x = 1\n", "kde/_b.py": "from scalegp._validation import x\n"}
    assert _kinds(_found(tmp_path, files)) == set()


@pytest.mark.parametrize("name, bad", [("gp_scale_32k_2823de1_rerun_cpu.json", True),
                                       ("matern_ratio_before_cpu.json", True),
                                       ("gp_scale_32k_cpu.json", False),
                                       ("kernel_mv_cpu.json", False)])
def test_result_names(tmp_path, name, bad):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / name).write_text("{}")
    assert bool(check_structure.check_results(tmp_path)) == bad
