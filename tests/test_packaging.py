"""The build lists every package: a subpackage missing from pyproject.toml installs fine in
editable mode (which the tests use) and is absent from a wheel (which users install)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_in_the_build():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "scalegp").rglob("__init__.py")}
    assert on_disk <= listed, f"missing from pyproject.toml packages: {sorted(on_disk - listed)}"
    cli = ROOT / config["package-dir"]["scalegp.cli"]
    assert (cli / "__init__.py").is_file() and "scalegp.cli" in listed
