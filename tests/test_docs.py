"""The documents that describe the code stay true to it: docs/api.md documents exactly the names
of the ``__all__`` lists, as tools/api_docs.py writes them; every public name is used outside its
package; docs/architecture.md lists exactly the modules there are."""

import ast
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# tools/architecture.py loads the other two tools; one loader, shared with it.
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architecture)
api_docs, check_structure = architecture.api_docs, architecture.check_structure


def _public():
    return {(package, name) for package, names in api_docs.public_names().items()
            for name in names}


def test_api_md_documents_exactly_the_public_names():
    documented = set(re.findall(r"^### `(scalegp[\w.]*)\.(\w+)`$", api_docs.API_MD.read_text(),
                                re.M))
    public = _public()
    assert not public - documented, f"not in docs/api.md: {sorted(public - documented)}"
    assert not documented - public, f"in docs/api.md, in no __all__: {sorted(documented - public)}"


def test_every_public_module_with_an_all_is_documented():
    """A new public module with an ``__all__`` joins tools/api_docs.py's PACKAGES."""
    with_all = set()
    for name, path in check_structure.modules().items():
        parts = name.split(".")
        if parts[:2] == ["scalegp", "cli"] or any(part.startswith("_") for part in parts):
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                     for t in node.targets)
               for node in tree.body):
            with_all.add(name)
    assert with_all == set(api_docs.PACKAGES)


def test_constant_descriptions_are_for_uncommented_public_constants():
    public = _public()
    for name in api_docs.CONSTANTS:
        packages = [package for package, public_name in public if public_name == name]
        assert packages, f"CONSTANTS[{name!r}]: no __all__ has it"
        assert not api_docs._constant_comment(packages[0], name), (
            f"CONSTANTS[{name!r}]: its assignment has a #: comment now; drop the entry")


def test_api_md_is_current():
    assert api_docs.render() == api_docs.API_MD.read_text(), (
        "docs/api.md is out of date: run python tools/api_docs.py")


def test_public_names_are_used_outside_their_package():
    unused = api_docs.unused()
    assert not unused, (
        f"used by nothing outside their package (scalegp/, cli/, examples/, benchmarks/; tests "
        f"do not count): drop from __all__: {sorted(unused)}")


def test_architecture_md_lists_every_module_and_import():
    """Every module of scalegp/ and cli/ has its line in docs/architecture.md, no line names a
    module that is gone, and the imports between packages are as generated."""
    problems = architecture.problems()
    assert not problems, "\n".join(problems)


def test_architecture_check_catches_a_missing_and_a_stale_module(tmp_path):
    for path, source in {"scalegp/__init__.py": "", "scalegp/ops/__init__.py": "x = 1\n",
                         "scalegp/ops/_a.py": "", "scalegp/kde/__init__.py":
                         "from scalegp.ops import x\n", "cli/__init__.py": ""}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(source)
    imports = architecture.imports_section(tmp_path)
    assert "- kde → ops: `x`" in imports
    tree = "scalegp/\n  ops/   engine\n    _b.py   gone\n  kde/\ncli/\n"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        f"## Modules\n\n```\n{tree}```\n\n{architecture.BEGIN}\n{architecture.END}\n")
    assert sorted(architecture.problems(tmp_path)) == [
        "docs/architecture.md does not list scalegp.ops._a",
        "docs/architecture.md lists scalegp.ops._b, which does not exist",
        "docs/architecture.md's imports section is out of date: run python tools/architecture.py",
    ]
