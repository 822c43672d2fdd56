"""Writes docs/api.md, the public surface: one entry per name of each package's ``__all__``.

    python tools/api_docs.py           # rewrite docs/api.md
    python tools/api_docs.py --check   # exit 1 if docs/api.md is not what this would write
    python tools/api_docs.py --unused  # the __all__ names nothing outside their package uses

Each entry is generated from the object itself, so it stays true: the signature (annotations as
written, defaults as values), then the docstring's contract: its text up to a numpy-style
``Parameters`` / ``Attributes`` section (the estimators' parameter lists stay in their class
docstrings), Google-style ``Args:`` / ``Returns:`` / ``Raises:`` included. A constant shows its
value and the ``#:`` comment above its assignment (or, lacking one, its line in CONSTANTS).
tests/test_docs.py checks that the file is current and that it documents exactly the names of the
``__all__`` lists.

``--unused`` lists the names no module outside their package uses (in USERS: tests do not
count): imported (``from scalegp.kde import fit_kde``), read as an attribute through any import
alias (``kde.fit_kde``), re-exported by the root package, or the documented type of a public
fitted attribute (``scaling_ : scalegp.kde.Scaling`` in a numpy-style docstring).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"
# Where a public name must be used, outside its own package (tests do not count).
USERS = ("scalegp", "cli", "examples", "benchmarks")
# Every package (or public module) with an __all__, in the order of the layers, top first.
PACKAGES = ("scalegp", "scalegp.estimators", "scalegp.persistence", "scalegp.gp", "scalegp.kde",
            "scalegp.linalg", "scalegp.ops", "scalegp.distributed")
# What a constant is for, where its assignment has no ``#:`` comment to say it.
CONSTANTS = {
    "SCALES": "The values of ``scale=``: None (a shift only), per-feature standardisation, or "
              "whitening by the weighted covariance (see the package docstring).",
    "BANDWIDTH_RULES": "Rule-of-thumb bandwidths ``bandwidth=`` accepts: Scott's and "
                       "Silverman's factors times each feature's standard deviation.",
    "CV_BANDWIDTHS": "Cross-validated bandwidths ``bandwidth=`` accepts: one scalar, or one per "
                     "feature (`cross_validate_bandwidth`).",
    "DEFAULT_BATCH_SIZE": "Queries per engine call in `log_density` (memory: a batch's "
                          "log-densities and the engine's tiles, whatever the data's size).",
    "DEFAULT_CV_SUBSAMPLE": "Held-out points in the cross-validation objective unless "
                            "``cv_subsample`` says otherwise (each scored against all data).",
}
_ATTRIBUTE_TYPE = re.compile(r"^\s+[a-z]\w*_ : (scalegp(?:\.\w+)+)", re.M)
# numpy-style section headers: the contract stops before them.
_NUMPY_SECTION = re.compile(r"^(Parameters|Attributes|Examples|Notes|See Also)\n-{3,}$", re.M)

HEADER = """\
# API

The public surface of scalegp: every name in a package's `__all__`, with its signature and
contract. Generated from the docstrings by `tools/api_docs.py` (do not edit by hand; run
`python tools/api_docs.py` after changing a public docstring or an `__all__`);
`tests/test_docs.py` fails when this file is out of date. Most users need only the two
estimators; the packages below them are the layers they are built on (`docs/architecture.md`).
"""


def _default(value) -> str:
    """A default value as it would be written, without memory addresses."""
    text = repr(value)
    if inspect.isclass(value) or " at 0x" in text:
        module = getattr(value, "__module__", "") or ""
        name = getattr(value, "__name__", text)
        return f"jnp.{name}" if module.startswith("jax") else name
    return text


def signature(name: str, obj) -> str:
    """``name(parameters) -> return``, annotations as written in the source."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    parts, star = [], False
    for param in sig.parameters.values():
        if param.kind is param.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "")
        text += param.name
        if param.kind is param.VAR_POSITIONAL:
            star = True
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
            if param.default is not param.empty:
                text += f" = {_default(param.default)}"
        elif param.default is not param.empty:
            text += f"={_default(param.default)}"
        parts.append(text)
    returns = ""
    if sig.return_annotation is not sig.empty and not inspect.isclass(obj):
        returns = f" -> {_annotation(sig.return_annotation)}"
    text = f"{name}({', '.join(parts)}){returns}"
    if len(text) > 100:  # one parameter a line, as black would
        text = f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"
    return text


def _annotation(annotation) -> str:
    # `from __future__ import annotations` keeps them as the strings written
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def contract(obj) -> str:
    """The docstring up to its first numpy-style section."""
    doc = inspect.getdoc(obj) or ""
    match = _NUMPY_SECTION.search(doc)
    return (doc[: match.start()] if match else doc).strip()


def _constant_comment(module_name: str, name: str) -> str:
    """The ``#:`` comment block right above ``name = ...`` in the package's modules."""
    module = importlib.import_module(module_name)
    paths = [Path(module.__file__)]
    if paths[0].name == "__init__.py":
        paths = sorted(paths[0].parent.glob("*.py"))
    for path in paths:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(rf"{name}\s*(:[^=]*)?=", line):
                comment = []
                while i > 0 and lines[i - 1].startswith("#:"):
                    i -= 1
                    comment.insert(0, lines[i][2:].strip())
                return "\n".join(comment)
    return ""


def entry(package: str, name: str, seen: dict[int, str]) -> str:
    obj = getattr(importlib.import_module(package), name)
    lines = [f"### `{package}.{name}`", ""]
    if id(obj) in seen:
        return "\n".join(lines + [f"The same object as `{seen[id(obj)]}`.", ""])
    if inspect.isclass(obj) or inspect.isfunction(obj) or callable(obj):
        seen[id(obj)] = f"{package}.{name}"
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            bases = ", ".join(base.__name__ for base in obj.__bases__)
            lines += ["```python", f"class {name}({bases})", "```"]
        else:
            prefix = "class " if inspect.isclass(obj) else ""
            lines += ["```python", prefix + signature(name, obj), "```"]
        text = contract(obj)
    else:
        lines += ["```python", f"{name} = {obj!r}", "```"]
        text = _constant_comment(package, name) or CONSTANTS.get(name, "")
    return "\n".join(lines + ([""] + [text] if text else []) + [""])


def render() -> str:
    out, seen = [HEADER], {}
    # The estimators first, so that the root's lazy re-exports point to them.
    order = ("scalegp.estimators",) + tuple(p for p in PACKAGES if p != "scalegp.estimators")
    sections = {}
    for package in order:
        module = importlib.import_module(package)
        summary = (inspect.getdoc(module) or "").split("\n\n")[0].replace("\n", " ")
        body = [f"## `{package}`", "", summary, ""]
        body += [entry(package, name, seen) for name in module.__all__]
        sections[package] = "\n".join(body)
    out += [sections[package] for package in PACKAGES]
    return "\n".join(out).rstrip() + "\n"


def public_names(root: Path = ROOT) -> dict[str, list[str]]:
    """Package -> its ``__all__``, read from the source (no import)."""
    found = {}
    for package in PACKAGES:
        path = _source(package, root)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
                found[package] = list(ast.literal_eval(node.value))
    return found


def _source(module: str, root: Path = ROOT) -> Path:
    path = root.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _module_name(path: Path, root: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "cli":  # installed as scalegp.cli
        parts.insert(0, "scalegp")
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def uses(root: Path = ROOT, targets=PACKAGES, users=USERS) -> dict[tuple[str, str], set[str]]:
    """(module, name) -> the files in ``users`` that import the name from one of the ``targets``
    or read it as an attribute of it (``from scalegp.kde import fit_kde``, ``kde.fit_kde``)."""
    packages, found = set(targets), {}
    for path in sorted(p for folder in users for p in (root / folder).rglob("*.py")):
        module, is_package = _module_name(path, root)
        shown = str(path.relative_to(root))
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError:
            continue
        # A public fitted attribute's documented type (numpy style, ``scaling_ : scalegp.kde.Scaling``)
        # hands the user an object of that class: a use.
        for match in _ATTRIBUTE_TYPE.finditer(path.read_text()):
            package, _, name = match.group(1).rpartition(".")
            if package in packages:
                found.setdefault((package, name), set()).add(shown)
        alias = {}  # local name -> the package it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = module.split(".") if is_package else module.split(".")[:-1]
                target = (".".join(base[: len(base) - node.level + 1] + [node.module or ""])
                          .strip(".") if node.level else node.module or "")
                for name in node.names:
                    if f"{target}.{name.name}" in packages:
                        alias[name.asname or name.name] = f"{target}.{name.name}"
                    elif target in packages:
                        found.setdefault((target, name.name), set()).add(shown)
            elif isinstance(node, ast.Import):
                for name in node.names:
                    if name.name in packages:
                        alias[name.asname or name.name.split(".")[0]] = (
                            name.name if name.asname else name.name.split(".")[0])
        for node in ast.walk(tree):
            chain = []
            while isinstance(node, ast.Attribute):
                chain.insert(0, node.attr)
                node = node.value
            if not (chain and isinstance(node, ast.Name) and node.id in alias):
                continue
            package = alias[node.id]
            for part in chain:
                if f"{package}.{part}" not in packages:
                    found.setdefault((package, part), set()).add(shown)
                    break
                package = f"{package}.{part}"
    return found


def unused(root: Path = ROOT) -> list[tuple[str, str]]:
    """The ``__all__`` names that nothing outside their package uses (tests do not count). The
    root package's names are the estimators', re-exported: that counts as their use."""
    found, public = uses(root), public_names(root)
    missing = []
    for package, names in public.items():
        home = _source(package, root)
        home = home.parent if home.name == "__init__.py" else home
        for name in names:
            users = {user for user in found.get((package, name), ())
                     if not (root / user).is_relative_to(home)}
            if package == "scalegp.estimators" and name in public.get("scalegp", ()):
                users.add("scalegp/__init__.py")
            if not users:
                missing.append((package, name))
    return missing


def main(argv: list[str]) -> int:
    if "--unused" in argv:
        for package, name in unused():
            print(f"{package}.{name}")
        return 0
    text = render()
    if "--check" in argv:
        current = API_MD.read_text() if API_MD.exists() else ""
        if current != text:
            print("docs/api.md is out of date: run python tools/api_docs.py", file=sys.stderr)
            return 1
        return 0
    API_MD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
