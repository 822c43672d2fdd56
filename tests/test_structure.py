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

#: What a made-up module opens with, unless its source says otherwise (the concept rule).
DOC = '"""A module."""\n'


def test_repository_keeps_its_structure_rules():
    problems = check_structure.problems()
    assert not problems, "\n".join(problems)


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    """The made-up package; a non-empty source without a docstring of its own gets `DOC`."""
    for name, source in files.items():
        path = root / "scalegp" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        source = textwrap.dedent(source)
        if source and not source.startswith(('"""', "#")):
            source = DOC + source
        path.write_text(source)
    return {"scalegp": root / "scalegp"}


def _found(tmp_path, files):
    sources = _package(tmp_path, {"__init__.py": "", "ops/__init__.py": "", **files})
    return check_structure.problems(root=tmp_path, sources=sources)


def _kinds(problems):
    return {problem.split(":")[0] for problem in problems if not problem.startswith("tests:")}


# Made-up modules in the ops layers (tools/check_structure.py's OPS_LAYERS): two leaves.
A, B = "ops/_checks.py", "ops/_prepare.py"


def test_clean_package_passes(tmp_path):
    files = {"ops/_rbf.py": "from scalegp.ops._checks import value\n", A: "value = 1\n",
             "kde/__init__.py": "from scalegp.ops import _rbf\n"}
    assert _kinds(_found(tmp_path, files)) == {"private"}  # kde takes ops' private module
    files["kde/__init__.py"] = "from scalegp.ops import value\n"
    files["ops/__init__.py"] = "from scalegp.ops._checks import value\n"
    assert _kinds(_found(tmp_path, files)) == set()


TWO_BACKENDS = {"ops/backends/__init__.py": "", "ops/backends/triton/__init__.py": "B = 1\n",
                "ops/backends/xla/__init__.py": "B = 1\n"}


@pytest.mark.parametrize("files, kind", [
    ({A: "from scalegp.ops._prepare import x\n", B: "from scalegp.ops._checks import y\n"},
     "cycle"),
    ({A: "x = 1\n", B: "def f():\n    from scalegp.ops._checks import x\n    return x\n"},
     "nested"),
    ({A: "_x = 1\n", B: "from ._checks import _x\n"}, "private"),
    ({A: "x = 1\n", "kde/_b.py": "from scalegp.ops._checks import x\n"}, "private"),
    ({A: "x = 1\n" * 3000}, None),  # no line cap: a module holds one concept, however long
    ({A: "# no docstring\nx = 1\n"}, "concept"),
    ({A: "def f():\n" + "    x = 1\n" * 91 + "    return x\n"}, "function"),
    # the ops layers: a leaf takes the plan; a module in no layer; a backend takes another;
    # a product takes a backend (only the plan does)
    ({A: "from scalegp.ops._plan import x\n", "ops/_plan.py": "x = 1\n"}, "ops layers"),
    ({"ops/_new.py": "x = 1\n"}, "ops layers"),
    ({**TWO_BACKENDS, "ops/backends/xla/_a.py": "from scalegp.ops.backends import triton\n"},
     "ops layers"),
    ({**TWO_BACKENDS, "ops/_rbf.py": "from scalegp.ops.backends.xla import B\n"},
     "ops layers"),
    # names compared outside the plan
    ({"ops/_rbf.py": "def f(impl):\n    return impl == 'xla'\n"}, "names"),
    ({"ops/_rbf.py": "import jax\nGPU = jax.default_backend() == 'gpu'\n"}, "names"),
    ({"gp/_exact.py": "def f(platform):\n    return platform in ('cpu',)\n"}, "names"),
    # the shared tile arithmetic written a second time
    ({A: "import jax\nf = jax.custom_vjp(abs)\n"}, "once"),
    ({"kde/_loo.py": "import math\nc = math.log(2 * math.pi)\n"}, "once"),
    ({A: "def f(run_max, new_max):\n    return jnp.exp(run_max - new_max)\n"}, "once"),
    ({"gp/_exact.py": "import math\nc = math.log(2 * math.pi)\n"}, None),  # not the KDE's
])
def test_each_rule_is_caught(tmp_path, files, kind):
    kinds = _kinds(_found(tmp_path, files))
    assert kind in kinds if kind else not kinds


def test_the_plan_and_other_words_may_compare_names(tmp_path):
    files = {**TWO_BACKENDS, "ops/_plan.py": (
        "from scalegp.ops.backends import xla\n\ndef f(impl):\n    return impl == 'xla'\n"),
        "linalg/_lanczos.py": "def f(method):\n    return method == 'dense'\n"}
    assert _kinds(_found(tmp_path, files)) == set()


def test_docstrings_and_comments_are_not_code_lines(tmp_path):
    body = '    """' + "doc\n" * 100 + '    """\n' + "    # why\n" * 100 + "    return 1\n"
    assert _kinds(_found(tmp_path, {A: "def f():\n" + body})) == set()


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
