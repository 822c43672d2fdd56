"""`gp fit --kernel`: a kernel formula such as ``rbf + 1.0*rbf*periodic(period=1) + rq`` read
into a scikit-learn kernel.

The text (ASCII) is parsed with :mod:`ast` and only an allow-list of nodes is accepted (terms,
positive numbers, ``+``, ``*``, parentheses, ``term(parameter=number)``); nothing is ever
evaluated. Sums and products become balanced trees of scikit-learn kernels (`_balanced`).
"""

from __future__ import annotations

import ast
import math
from typing import NoReturn

from .common import CLIError

#: Longer text is refused before parsing (a formula is a line; this bounds the parser's work).
MAX_LENGTH = 500

_LENGTHSCALE = {"lengthscale": "length_scale"}

#: term -> (scikit-learn class, fixed arguments, {parameter: scikit-learn argument})
TERMS = {
    "rbf": ("RBF", {}, _LENGTHSCALE),
    "matern12": ("Matern", {"nu": 0.5}, _LENGTHSCALE),
    "matern32": ("Matern", {"nu": 1.5}, _LENGTHSCALE),
    "matern52": ("Matern", {"nu": 2.5}, _LENGTHSCALE),
    "matern": ("Matern", {"nu": 1.5}, {**_LENGTHSCALE, "nu": "nu"}),
    "rq": ("RationalQuadratic", {}, {**_LENGTHSCALE, "alpha": "alpha"}),
    "periodic": ("ExpSineSquared", {}, {**_LENGTHSCALE, "period": "periodicity"}),
    "white": ("WhiteKernel", {}, {"noise": "noise_level"}),
}

#: The Matérn smoothness values with closed forms (others need Bessel functions).
MATERN_NU = (0.5, 1.5, 2.5)

EXAMPLE = "rbf + 2*rbf*periodic(period=1) + white(noise=0.1)"

HELP = (
    "Kernel formula instead of the default RBF model, e.g. 'rbf + rbf*periodic(period=1)' or "
    "'matern52(lengthscale=2) + 0.5*rq(alpha=2)'. Terms: rbf, matern12, matern32, matern52, "
    "matern(nu=0.5|1.5|2.5), rq, periodic, white; parameters by name: lengthscale, alpha (rq), "
    "period (periodic), noise (white). Combine with + and * and parentheses; a number alone "
    "is a constant term. Every number is an initial value, learnt, in the units the GP sees "
    "(--no-standardize to give a period in data units). A top-level term without a number "
    "factor gets a learnt outputscale; without a white term, white noise starting at --noise "
    "is added. Lengthscales are shared by all features. At most 32 kernels in all, 16 terms in "
    "a sum and 8 factors in a product, counting the outputscales and the noise added."
)


def parse_kernel(text: str, *, noise: float = 0.1, add_noise: bool = True):
    """The scikit-learn kernel that ``text`` describes.

    Rules beyond the grammar: each top-level term (summand) that has no number among its
    factors is multiplied by a learnt ``ConstantKernel(1.0)`` (its outputscale); ``white`` may
    appear once, as a top-level term on its own, and when it is absent (and ``add_noise``: a
    regression's targets, not a classifier's latent function) ``WhiteKernel(noise)`` is added,
    so that the noise is learnt as in the default model. A bare ``white`` starts at ``noise``
    too. Raises :class:`CLIError` (one line naming the offending part) otherwise.
    """
    from sklearn.gaussian_process.kernels import ConstantKernel, WhiteKernel

    body, source = _syntax_tree(text)
    builder = _Builder(source, noise)
    summands = []
    whites = 0
    for node in _flatten(body, ast.Add):
        if _is_white(node):
            whites += 1
            summands.append(builder.term(node))
            continue
        if any(_is_white(part) for part in ast.walk(node)):
            _fail(f"{builder.text(node)!r}: white is the noise and must be a term on its own, "
                  "e.g. 'rbf + white(noise=0.1)'")
        kernel = builder.build(node)
        factors = _flatten(node, ast.Mult)
        if not any(_is_number(factor) for factor in factors):
            kernel = ConstantKernel(1.0) * kernel
        summands.append(kernel)
    if whites > 1:
        _fail(f"{whites} white terms; give at most one (the noise)")
    if not whites and add_noise:
        summands.append(WhiteKernel(noise_level=noise))
    return _balanced(summands, ast.Add)


def _balanced(parts: list, op: type):
    """``parts`` joined by ``+`` (``op`` ast.Add) or ``*`` in balanced parentheses, the left
    half first: ``(a + b) + (c + d)``, log2 of their number deep rather than one level per part
    (scikit-learn's Sum and Product read their operands' bounds twice, so its work doubles with
    each level). Up to three parts this is the left-to-right chain ``a + b + c``."""
    if len(parts) == 1:
        return parts[0]
    half = (len(parts) + 1) // 2
    left, right = _balanced(parts[:half], op), _balanced(parts[half:], op)
    return left + right if op is ast.Add else left * right


def _syntax_tree(text) -> tuple[ast.expr, str]:
    """The expression's tree, and the text it was parsed from (whitespace normalised)."""
    if not isinstance(text, str) or not text.strip():
        _fail(f"the formula is empty; give one such as '{EXAMPLE}'")
    if len(text) > MAX_LENGTH:
        _fail(f"the formula has {len(text):,} characters; at most {MAX_LENGTH} are allowed")
    source = " ".join(text.split())  # newlines and tabs are spaces in a formula
    other = next((c for c in source if not c.isascii()), None)
    if other is not None:  # Python reads 'ｒｂｆ' as rbf (NFKC): accept the ASCII spelling only
        _fail(f"{other!r} (U+{ord(other):04X}) at character {text.index(other) + 1} is not "
              f"ASCII; write names and numbers in ASCII, e.g. '{EXAMPLE}'")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as error:
        where = f" at character {error.offset}" if error.offset else ""
        _fail(f"{_shorten(source)!r} is not a formula ({error.msg}{where}); write terms joined "
              f"by + and *, e.g. '{EXAMPLE}'")
    except (ValueError, RecursionError, MemoryError):  # a null byte; absurd nesting
        _fail(f"{_shorten(source)!r} is not a formula; write terms joined by + and *, e.g. "
              f"'{EXAMPLE}'")
    return tree.body, source


class _Builder:
    """Turns allowed nodes into kernels; anything else is an error naming its text."""

    def __init__(self, source: str, noise: float):
        self.source = source
        self.noise = noise

    def build(self, node: ast.expr):
        # Sums and products are flattened rather than recursed into: a long formula stays
        # shallow here whatever the parser's nesting.
        for op in (ast.Add, ast.Mult):
            if isinstance(node, ast.BinOp) and isinstance(node.op, op):
                return _balanced([self.build(part) for part in _flatten(node, op)], op)
        if isinstance(node, ast.BinOp):
            _fail(f"{_symbol(node.op)!r} in {self.text(node)!r} is not allowed; combine terms "
                  "with + and * only")
        if _is_number(node):
            from sklearn.gaussian_process.kernels import ConstantKernel

            return ConstantKernel(self.number(node))
        if isinstance(node, ast.UnaryOp):
            _fail(f"{self.text(node)!r} is not allowed: numbers must be positive and terms "
                  "combine with + and * only")
        if isinstance(node, (ast.Name, ast.Call)):
            return self.term(node)
        _fail(f"{self.text(node)!r} is not allowed; a formula has terms ({', '.join(TERMS)}), "
              f"positive numbers, + and *, parentheses and term(parameter=number), e.g. "
              f"'{EXAMPLE}'")

    def term(self, node: ast.Name | ast.Call):
        """``name`` or ``name(parameter=number, ...)`` as its scikit-learn kernel."""
        from sklearn.gaussian_process import kernels

        call = node if isinstance(node, ast.Call) else None
        if call is not None and not isinstance(call.func, ast.Name):
            _fail(f"{self.text(node)!r} is not allowed: only a term's name takes parameters, "
                  "e.g. rbf(lengthscale=2)")
        name = (call.func if call is not None else node).id
        if name not in TERMS:
            _fail(f"unknown term {name!r}; the terms are {', '.join(TERMS)}")
        class_name, arguments, parameters = TERMS[name]
        arguments = dict(arguments)
        if name == "white":
            arguments["noise_level"] = self.noise
        if call is not None:
            if call.args or any(k.arg is None for k in call.keywords):
                _fail(f"{self.text(node)!r}: give parameters by name, e.g. "
                      f"{name}({next(iter(parameters))}=2)")
            given = [keyword.arg for keyword in call.keywords]
            for keyword in call.keywords:
                if given.count(keyword.arg) > 1:
                    _fail(f"{self.text(node)!r} gives {keyword.arg} twice")
                if keyword.arg not in parameters:
                    _fail(f"{name} has no parameter {keyword.arg!r}; it takes "
                          f"{', '.join(parameters)}")
                value = self.number(keyword.value, f"{name}({keyword.arg}=...)")
                if keyword.arg == "nu" and value not in MATERN_NU:
                    _fail(f"matern(nu=...) must be one of {', '.join(map(str, MATERN_NU))}, got "
                          f"{self.text(keyword.value)}")
                arguments[parameters[keyword.arg]] = value
        return getattr(kernels, class_name)(**arguments)

    def number(self, node: ast.expr, what: str | None = None) -> float:
        """A positive, finite number literal as a float; ``what`` names a parameter."""
        value = math.nan
        if _is_number(node):
            try:
                value = float(node.value)
            except OverflowError:  # an integer literal beyond float's range
                value = math.inf
        if not (math.isfinite(value) and value > 0):
            _fail(f"{what} must be a positive finite number, got {self.text(node)}" if what
                  else f"numbers must be positive and finite, got {self.text(node)}")
        return value

    def text(self, node: ast.expr) -> str:
        return _shorten(ast.get_source_segment(self.source, node) or type(node).__name__)


def _flatten(node: ast.expr, op: type) -> list[ast.expr]:
    """The operands of a chain of ``op`` (``a + (b + c)`` -> a, b, c), left to right."""
    parts, pending = [], [node]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.BinOp) and isinstance(node.op, op):
            pending += [node.right, node.left]
        else:
            parts.append(node)
    return parts


def _is_number(node: ast.expr) -> bool:
    # bool is an int subclass: True is not a number here
    return (isinstance(node, ast.Constant) and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool))


def _is_white(node: ast.expr) -> bool:
    name = node.func if isinstance(node, ast.Call) else node
    return isinstance(name, ast.Name) and name.id == "white"


_SYMBOLS = {ast.Sub: "-", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
            ast.MatMult: "@", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|",
            ast.BitXor: "^", ast.BitAnd: "&"}


def _symbol(op: ast.operator) -> str:
    return _SYMBOLS.get(type(op), type(op).__name__)


def _shorten(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _fail(problem: str) -> NoReturn:
    raise CLIError(f"--kernel: {problem}")
