"""Structural checks (issues 37 and 59), run by CI through tests/test_structure.py.

    python tools/check_structure.py        # prints every violation; exit 1 if any

Checks:
- concept: every module in scalegp/ and cli/ opens with a docstring that says what it holds (a
  module holds one concept, however long: a kernel family may be long; no line cap, which had
  split modules by line count rather than by concept);
- function: no function over MAX_FUNCTION_LINES code lines (docstrings, comments and blank
  lines excluded);
- cycle: no import cycle among scalegp's modules, imports inside functions included;
- nested: no import of a scalegp module inside a function of the library (imports are the layer
  map; a function import hides a cycle). Two deliberate lazy imports stay: the root package's
  PEP 562 ``__getattr__`` (``import scalegp`` does not pay for jax) and the command line, which
  parses arguments and answers ``--help`` before it imports the library;
- private: no module imports another module's private object (``from .a import _b``) or another
  package's private module (``from ..ops._xla import f``); a package may use its own private
  modules and those of the packages above it (``scalegp._validation`` is the whole library's);
- ops layers: inside scalegp.ops, imports flow leaves <- kernels and interface <- pruning <-
  backends <- plan <- products (`OPS_LAYERS`); a backend imports no other backend, and nothing
  outside a backend's folder imports its modules (the products ask the plan);
- names: no comparison with a backend's or a platform's name outside `scalegp.ops._plan` (a
  literal "cpu", "gpu" or "tpu" in a comparison, or a backend's name compared with something
  named impl, backend, platform or name): capabilities decide, the plan resolves names;
- once: the tile arithmetic every backend shares is written once, in `WRITTEN_ONCE`: the custom-VJP
  wiring (``custom_vjp``, ``defvjp``), the online log-sum-exp step and the Gaussian kernel's
  log-normaliser appear nowhere else in scalegp.ops and scalegp.kde;
- results: no file in benchmarks/results named after a commit or a before/after;
- tests: tests/ mirrors the packages (a directory per package).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 90
# cli/ is installed as scalegp.cli (pyproject's package-dir).
SOURCES = {"scalegp": ROOT / "scalegp", "scalegp.cli": ROOT / "cli"}
TEST_PACKAGES = ("cli", "estimators", "gp", "kde", "linalg", "ops", "persistence")
_COMMIT = re.compile(r"(^|[_\-.])[0-9a-f]{7,40}($|[_\-.])")
_BEFORE_AFTER = re.compile(r"(^|[_\-.])(before|after|rerun|old|new)($|[_\-.])")


def modules(sources: dict[str, Path] = SOURCES) -> dict[str, Path]:
    """Dotted module name -> path for every module of scalegp (cli included)."""
    found = {}
    for package, directory in sources.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def _is_package(name: str, table: dict[str, Path]) -> bool:
    return table[name].name == "__init__.py"


def _absolute(name: str, node: ast.ImportFrom, table: dict[str, Path]) -> str:
    if node.level == 0:
        return node.module or ""
    base = name.split(".") if _is_package(name, table) else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _nested_imports(tree) -> set[int]:
    """Line numbers of the imports that sit inside a function."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines.update(inner.lineno for inner in ast.walk(node)
                         if isinstance(inner, (ast.Import, ast.ImportFrom)))
    return lines


def imports(name: str, table: dict[str, Path]):
    """Yield (line, imported module, imported object or None) for each scalegp import in a module."""
    tree = ast.parse(table[name].read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "scalegp":
                    yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(name, node, table)
            if target.split(".")[0] != "scalegp":
                continue
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in table:
                    yield node.lineno, submodule, None
                else:
                    yield node.lineno, target, alias.name


def _owner(module: str, table: dict[str, Path]) -> str:
    """The longest known module a dotted name lives in."""
    while module and module not in table:
        module = module.rpartition(".")[0]
    return module


def _package_of(name: str, table: dict[str, Path]) -> str:
    return name if _is_package(name, table) else name.rpartition(".")[0]


def check_concepts(table) -> list[str]:
    """Every module opens with a docstring (what it holds)."""
    return [f"concept: {_shown(path)} has no module docstring saying what it holds"
            for name, path in table.items()
            if path.read_text().strip() and not ast.get_docstring(ast.parse(path.read_text()))]


#: The layers inside scalegp.ops, lowest first: a module imports ops modules of its own layer or
#: a lower one (a backend: its own folder, never another backend). Each entry: the layer's name
#: and the dotted prefixes (below scalegp.ops) of its modules.
OPS_LAYERS = (
    ("leaves", ("_checks", "_prepare", "_tiling", "_matmul", "_compat", "_profiles")),
    ("kernels and interface", ("_kernels", "_tile_math", "_interface")),
    ("pruning", ("pruning",)),
    ("backends", ("backends",)),
    ("plan", ("_plan",)),
    ("products", ("_rbf", "_expression", "sharding", "_dense", "_engine")),
)
#: The module allowed to compare backend and platform names.
PLAN_MODULE = "scalegp.ops._plan"
PLATFORM_NAMES = {"cpu", "gpu", "tpu"}
BACKEND_NAMES = {"dense", "xla", "triton", "mosaic", "pallas"}
_NAME_HOLDERS = re.compile(r"impl|backend|platform|\bname\b|\.name")
WRITTEN_ONCE = "scalegp.ops._tile_math"
#: What only `WRITTEN_ONCE` may write, by the code that gives it away: the custom-VJP wiring,
#: the online log-sum-exp step's rescaling of the running sum, and the normaliser's 2π.
_ONCE_PATTERNS = {
    "the custom-VJP wiring (use tile_product)": re.compile(r"custom_vjp|\.defvjp\("),
    "the online log-sum-exp step (use lse_step)": re.compile(r"exp\(\s*run_max\s*-"),
    "the Gaussian log-normaliser (use gaussian_log_norm)": re.compile(
        r"log\(\s*2\s*\*\s*(math|np|jnp)\.pi\s*\)"),
}


def _ops_layer(module: str):
    """(rank, layer name, backend or None) of a module of scalegp.ops; None for ops itself."""
    rest = module.removeprefix("scalegp.ops.")
    if rest == module or rest == "scalegp.ops":
        return None
    for rank, (layer, prefixes) in enumerate(OPS_LAYERS):
        for prefix in prefixes:
            if rest == prefix or rest.startswith(prefix + "."):
                parts = rest.split(".")
                backend = parts[1] if prefix == "backends" and len(parts) > 1 else None
                return rank, layer, backend
    return -1, "unlisted", None


def check_ops_layers(table) -> list[str]:
    problems = set()
    for name, path in table.items():
        own = _ops_layer(name)
        if own is None:
            continue
        if own[0] < 0:
            problems.add(f"ops layers: {_shown(path)} is in no layer of OPS_LAYERS")
            continue
        for line, module, _ in imports(name, table):
            target = _ops_layer(_owner(module, table))
            if target is None or target[0] < 0:
                continue
            where = f"{_shown(path)}:{line}"
            if target[0] > own[0]:
                problems.add(f"ops layers: {where} ({own[1]}) imports {module} ({target[1]})")
            elif target[2] is not None and own[2] is not None and target[2] != own[2]:
                problems.add(f"ops layers: {where} imports {module}, a module of another "
                             f"backend ({target[2]})")
            elif target[2] is not None and own[2] is None and name != PLAN_MODULE:
                problems.add(f"ops layers: {where} imports {module}: only the plan "
                             f"({PLAN_MODULE}) takes a backend; ask it")
    return sorted(problems)


def _literals(node) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
            and isinstance(n.value, str)}


def check_names(table) -> list[str]:
    """Comparisons with platform names anywhere, and with backend names against something
    named impl, backend, platform or name, outside `PLAN_MODULE`."""
    problems = []
    for name, path in table.items():
        if name == PLAN_MODULE:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.Compare):
                continue
            words = _literals(node)
            text = ast.get_source_segment(source, node) or ""
            platforms = words & PLATFORM_NAMES
            backends = words & BACKEND_NAMES if _NAME_HOLDERS.search(text) else set()
            if platforms or backends or "default_backend" in text:
                problems.append(f"names: {_shown(path)}:{node.lineno} compares with "
                                f"{sorted(platforms | backends) or 'the platform'}: ask a "
                                f"capability (scalegp.ops._plan) instead")
    return problems


def check_written_once(table) -> list[str]:
    """`_ONCE_PATTERNS` in the code (not docstrings or comments) of scalegp.ops and scalegp.kde
    outside `WRITTEN_ONCE`."""
    problems = []
    for name, path in table.items():
        if name == WRITTEN_ONCE or not name.startswith(("scalegp.ops", "scalegp.kde")):
            continue
        source = path.read_text()
        code = _code_lines(source)
        for number, line in enumerate(source.splitlines(), 1):
            if number not in code:
                continue
            line = line.split("#")[0]
            for what, pattern in _ONCE_PATTERNS.items():
                if pattern.search(line):
                    problems.append(f"once: {_shown(path)}:{number} writes {what} "
                                    f"({WRITTEN_ONCE})")
    return problems


def _code_lines(source: str) -> set[int]:
    """Line numbers holding code: not blank, not only a comment, not inside a docstring."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                          tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        lines.update(range(token.start[0], token.end[0] + 1))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                lines.difference_update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def check_functions(table) -> list[str]:
    problems = []
    for name, path in table.items():
        source = path.read_text()
        code = _code_lines(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                count = len(code & set(range(node.lineno, node.end_lineno + 1)))
                if count > MAX_FUNCTION_LINES:
                    problems.append(f"function: {_shown(path)}:{node.lineno} {node.name} has "
                                    f"{count} code lines (max {MAX_FUNCTION_LINES})")
    return problems


def graph(table) -> dict[str, set[str]]:
    edges = {name: set() for name in table}
    for name in table:
        for _, module, _ in imports(name, table):
            owner = _owner(module, table)
            if owner and owner != name:
                edges[name].add(owner)
    return edges


def check_cycles(table) -> list[str]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = graph(table)
    index, low, stack, on_stack, components = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [f"cycle: {' <-> '.join(c)}" for c in components]


def check_nested(table) -> list[str]:
    problems = []
    for name, path in table.items():
        if name == "scalegp" or name.startswith("scalegp.cli"):
            continue
        nested = _nested_imports(ast.parse(path.read_text()))
        lines = sorted({line for line, _, _ in imports(name, table) if line in nested})
        problems.extend(f"nested: {_shown(path)}:{line} imports a scalegp module inside a function"
                        for line in lines)
    return problems


def check_private(table) -> list[str]:
    problems = set()
    for name, path in table.items():
        package = _package_of(name, table)
        for line, module, obj in imports(name, table):
            owner = _owner(module, table)
            where = f"{_shown(path)}:{line}"
            if obj is not None and obj.startswith("_") and not obj.startswith("__") and owner != name:
                problems.add(f"private: {where} imports {owner}.{obj}")
            # Another package's private module: any private component below the importer's package.
            parts = owner.split(".")
            for depth in range(1, len(parts)):
                if parts[depth].startswith("_") and not parts[depth].startswith("__"):
                    parent = ".".join(parts[:depth])
                    if not (package == parent or package.startswith(parent + ".")):
                        problems.add(f"private: {where} imports {'.'.join(parts[:depth + 1])}, "
                                        f"a private module of {parent}")
                    break
    return sorted(problems)


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def check_results(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted((root / "benchmarks" / "results").glob("*")):
        stem = path.name.split(".")[0]
        if _COMMIT.search(stem) or _BEFORE_AFTER.search(stem):
            problems.append(f"results: {path.name} is named after a commit or a before/after")
    return problems


def check_tests(root: Path = ROOT) -> list[str]:
    return [f"tests: tests/{package}/ is missing" for package in TEST_PACKAGES
            if not (root / "tests" / package / "__init__.py").exists()]


def problems(root: Path = ROOT, sources: dict[str, Path] = SOURCES) -> list[str]:
    table = modules(sources)
    return (check_concepts(table) + check_functions(table) + check_cycles(table)
            + check_nested(table) + check_private(table) + check_ops_layers(table)
            + check_names(table) + check_written_once(table) + check_results(root)
            + check_tests(root))


def main() -> int:
    found = problems()
    for problem in found:
        print(problem)
    print(f"{len(found)} problem(s)", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
