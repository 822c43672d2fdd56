"""scikit-learn kernel objects as `scalegp.ops` kernel expressions.

`KernelSpec.from_sklearn` reads the structure of a scikit-learn kernel built from ConstantKernel,
RBF, Matern (ν in 1/2, 3/2, 5/2), RationalQuadratic, ExpSineSquared, WhiteKernel, Sum and
Product, with its values, bounds and "fixed" flags. `KernelSpec.build(theta)` gives the engine's
expression and the noise variance from ``theta``, the logarithms of the free hyperparameters in
scikit-learn's order (``kernel.theta``), differentiably: the kernel is never evaluated through
scikit-learn. WhiteKernel terms (alone or times constants, at the top level of the sum) become
the noise on the diagonal. scikit-learn's ``alpha`` (a scalar or one value per training point,
added to the training points' diagonal only) is not part of the spec: the solvers take it as
`scalegp.gp.KernelParams.fixed_noise` (`check_alpha` checks it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.gaussian_process import kernels as sk

from scalegp import ops

SUPPORTED = ("ConstantKernel", "RBF", "Matern (nu 0.5, 1.5, 2.5)", "RationalQuadratic",
             "ExpSineSquared", "WhiteKernel", "Sum (+)", "Product (*)")

#: The largest kernels accepted (`check_size`), from the estimator, the command line's formulas
#: and model files alike. Depth: scikit-learn's Sum and Product compute their ``bounds`` from
#: each operand's twice, so the work doubles with each level of nesting (every fit reads them;
#: a chain of 70 products never finished); at 10 levels a read costs about 2^10 leaves' reads.
#: Leaves: the compiled objective grows linearly with them; 32 is eight times the CO2 kernel's
#: 4 terms of up to 3 factors (a fit at the limits: the slow test in
#: tests/estimators/test_gpr_kernels.py).
MAX_DEPTH = 10
MAX_LEAVES = 32
MAX_TERMS = 16
MAX_FACTORS = 8

# scikit-learn hyperparameter names -> the engine's field names, per kernel class
_FIELDS = {
    sk.ConstantKernel: (ops.Constant, {"constant_value": "value"}),
    sk.RBF: (ops.RBF, {"length_scale": "lengthscale"}),
    sk.Matern: (ops.Matern, {"length_scale": "lengthscale"}),
    sk.RationalQuadratic: (ops.RationalQuadratic, {"length_scale": "lengthscale",
                                                   "alpha": "alpha"}),
    sk.ExpSineSquared: (ops.ExpSineSquared, {"length_scale": "lengthscale",
                                             "periodicity": "period"}),
}


def _unsupported(kernel, why=""):
    shown = repr(kernel)
    name = type(kernel).__name__
    if not shown.startswith(name) and not isinstance(kernel, (sk.KernelOperator,
                                                               sk.Exponentiation)):
        # e.g. a ConstantKernel subclass shows as "1**2"
        shown = f"{name} {shown}"
    if not why:
        base = next((cls.__name__ for cls in _FIELDS if isinstance(kernel, cls)), None)
        if base is not None:
            why = f" (a subclass of {base}: only the scikit-learn classes themselves are)"
    return ValueError(
        f"kernel {shown} is not supported{why}; scalegp takes scikit-learn kernels "
        f"built from {', '.join(SUPPORTED)}, with WhiteKernel only as a term of the top-level "
        "sum (alone or times ConstantKernels)"
    )


@dataclasses.dataclass(frozen=True)
class _Param:
    """One hyperparameter: free (``theta[start:start + size]`` are its logarithms) or fixed
    (``value``, a tuple of floats); ``scalar`` when it is one number in the engine."""

    start: int | None
    size: int
    value: tuple
    scalar: bool

    def resolve(self, theta):
        if self.start is None:
            values = jnp.asarray(self.value, theta.dtype)
        else:
            values = jnp.exp(theta[self.start: self.start + self.size])
        return values[0] if self.scalar else values


@dataclasses.dataclass(frozen=True)
class _Node:
    """An engine kernel node: its class, static settings (Matérn's ν) and parameters."""

    cls: type
    params: tuple  # ((engine field name, _Param), ...)
    static: tuple = ()  # ((field name, value), ...)

    def build(self, theta) -> ops.Kernel:
        fields = {name: p.resolve(theta) for name, p in self.params}
        return self.cls(**fields, **dict(self.static))


@dataclasses.dataclass(frozen=True)
class _Combination:
    cls: type  # ops.Sum or ops.Product
    terms: tuple

    def build(self, theta) -> ops.Kernel:
        return self.cls(tuple(t.build(theta) for t in self.terms))


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A scikit-learn kernel's structure, hashable (a static argument of the solvers' jit).

    Attributes:
      kernel: the covariance part as engine nodes.
      noise: the WhiteKernel terms, each a tuple of factors (``_Param`` of the noise level and
        of the constants multiplying it), summed.
      n_theta: length of theta.
    """

    kernel: object
    noise: tuple
    n_theta: int

    @classmethod
    def from_sklearn(cls, kernel) -> "KernelSpec":
        """The spec of ``kernel``; a ValueError naming what is supported otherwise."""
        check_size(kernel)
        reader = _Reader()
        covariance, noise = [], []
        for term in _summands(kernel):
            white = _white_factors(term)
            if white is not None:
                noise.append(tuple(reader.param(k, name) for k, name in white))
            else:
                covariance.append(reader.node(term))
        if not covariance:
            raise _unsupported(kernel, ": it has no covariance term besides WhiteKernel")
        expression = covariance[0] if len(covariance) == 1 else _Combination(
            ops.Sum, tuple(covariance))
        spec = cls(expression, tuple(noise), reader.size)
        _check_layout(kernel, reader)
        return spec

    def build(self, theta) -> tuple[ops.Kernel, jax.Array]:
        """``(engine kernel, noise variance)`` from ``theta (n_theta,)``: the noise is the sum
        of the WhiteKernel terms (0 without any), the variance of y at any point beyond f's."""
        noise = jnp.zeros((), theta.dtype)
        for factors in self.noise:
            level = factors[0].resolve(theta)
            for factor in factors[1:]:
                level = level * factor.resolve(theta)
            noise = noise + level
        return self.kernel.build(theta), noise


class _Reader:
    """Walks a scikit-learn kernel in its theta order, numbering the free hyperparameters."""

    def __init__(self):
        self.size = 0
        self.order = []  # (kernel, hyperparameter name) in the order theta holds them

    def param(self, kernel, name, per_feature=False):
        """Hyperparameter ``name`` of ``kernel``: one number, or with ``per_feature`` (RBF's
        and Matern's lengthscales) a 1-D array of them, checked with its bounds."""
        hyper = next(h for h in kernel.hyperparameters if h.name == name)
        what = f"{type(kernel).__name__}.{name}"
        given = getattr(kernel, name)
        value = _floats(given)
        if value is None:
            raise ValueError(f"{what} must be real, got {given!r:.200}")
        if value.ndim > 1 or (not per_feature and value.size != 1):
            expected = "a number or a 1-D array of one per feature" if per_feature else "a number"
            raise ValueError(f"{what} must be {expected}, got an array of shape {value.shape}")
        if not np.all(np.isfinite(value) & (value > 0)):
            raise ValueError(f"{what} must be positive and finite, got {given!r:.200}")
        if not hyper.fixed:
            _check_bounds(hyper, f"{what}_bounds", getattr(kernel, f"{name}_bounds"))
        scalar = value.ndim == 0 or value.size == 1
        value = np.atleast_1d(value)
        if hyper.fixed:
            return _Param(None, value.size, tuple(float(v) for v in value), scalar)
        start, self.size = self.size, self.size + value.size
        self.order.append((kernel, name, start, value.size))
        return _Param(start, value.size, tuple(float(v) for v in value), scalar)

    def node(self, kernel):
        if isinstance(kernel, (sk.Sum, sk.Product)):
            combination = ops.Sum if isinstance(kernel, sk.Sum) else ops.Product
            return _Combination(combination, (self.node(kernel.k1), self.node(kernel.k2)))
        engine_cls, names = _FIELDS.get(type(kernel), (None, None))
        if engine_cls is None:
            if isinstance(kernel, sk.WhiteKernel):
                raise _unsupported(kernel, " inside a product or a nested sum")
            raise _unsupported(kernel)
        static = ()
        if isinstance(kernel, sk.Matern):
            if float(kernel.nu) not in ops.MATERN_NUS:
                raise _unsupported(kernel, f": Matern nu={kernel.nu} (use 0.5, 1.5 or 2.5)")
            static = (("nu", float(kernel.nu)),)
        # scikit-learn's hyperparameter order within a kernel is alphabetical (dir())
        ordered = [h.name for h in kernel.hyperparameters]
        params = []
        for name in ordered:
            ard = name == "length_scale" and isinstance(kernel, (sk.RBF, sk.Matern))
            params.append((names[name], self.param(kernel, name, per_feature=ard)))
        return _Node(engine_cls, tuple(params), static)


def _floats(value) -> np.ndarray | None:
    """``value`` as a float64 array, or None when it is not real numbers: text, or complex
    numbers (numpy would drop their imaginary parts with only a warning)."""
    if isinstance(value, str):
        return None
    try:
        array = np.asarray(value)
        if np.iscomplexobj(array):
            return None
        return array.astype(np.float64)
    except (TypeError, ValueError):
        return None


def _check_bounds(hyper, what, given):
    """A free hyperparameter's bounds: ``0 <= low <= high`` for each element (0 and inf leave
    that side unbounded; the optimiser takes their logarithms)."""
    bounds = _floats(hyper.bounds)
    if bounds is None or not np.all((bounds[:, 0] >= 0) & (bounds[:, 0] <= bounds[:, 1])):
        raise ValueError(f'{what} must be (low, high) with 0 <= low <= high, or "fixed", got '
                         f"{given!r:.200}")


def check_size(kernel) -> None:
    """A ValueError when a scikit-learn kernel exceeds the limits (`MAX_DEPTH` levels of Sum
    and Product, `MAX_LEAVES` kernels, `MAX_TERMS` terms in a sum, `MAX_FACTORS` factors in a
    product, a nested chain of ``+`` or ``*`` counting as one sum or product), naming the limit
    and the count. The walk is linear in the kernel's nodes and never reads its bounds."""
    depth = leaves = terms = factors = 0
    pending = [(kernel, 0)]
    while pending:
        node, level = pending.pop()
        if not isinstance(node, (sk.Sum, sk.Product)):
            leaves += 1
            depth = max(depth, level)
            continue
        # the operands of the chain of this operator that starts here, with their levels
        op, operands, chain = type(node), 0, [(node, level)]
        while chain:
            link, at = chain.pop()
            if isinstance(link, op):
                chain += [(link.k1, at + 1), (link.k2, at + 1)]
            else:
                operands += 1
                pending.append((link, at))
        if issubclass(op, sk.Sum):
            terms = max(terms, operands)
        else:
            factors = max(factors, operands)
    for count, limit, problem, fix in [
        (depth, MAX_DEPTH, f"is nested {depth} levels deep (Sum and Product)",
         "scikit-learn's work on their bounds doubles with each level: group long sums and "
         "products in balanced parentheses, (k1 + k2) + (k3 + k4) rather than k1 + k2 + k3 + k4"),
        (terms, MAX_TERMS, f"has a sum of {terms} terms", "use fewer terms"),
        (factors, MAX_FACTORS, f"has a product of {factors} factors",
         "use fewer factors: a product of RBFs is one RBF, 1/l^2 summed"),
        (leaves, MAX_LEAVES, f"has {leaves} kernels",
         "use fewer terms and factors: the compiled objective grows with each"),
    ]:
        if count > limit:
            raise ValueError(f"the kernel {problem}; at most {limit} are allowed ({fix})")


def _summands(kernel):
    """The terms of the top-level sum, nested sums flattened."""
    if isinstance(kernel, sk.Sum):
        return _summands(kernel.k1) + _summands(kernel.k2)
    if not isinstance(kernel, sk.Kernel):
        raise TypeError(f"kernel must be a scikit-learn kernel object or None, got {kernel!r}")
    return [kernel]


def _white_factors(term):
    """``[(kernel, hyperparameter name), ...]`` in theta order when ``term`` is a WhiteKernel
    times ConstantKernels, else None."""
    factors = _product_factors(term)
    whites = [f for f in factors if isinstance(f, sk.WhiteKernel)]
    if not whites:
        return None
    if len(whites) > 1 or not all(isinstance(f, (sk.WhiteKernel, sk.ConstantKernel))
                                  for f in factors):
        raise _unsupported(term, ": WhiteKernel times a kernel other than ConstantKernel")
    return [(f, "noise_level" if isinstance(f, sk.WhiteKernel) else "constant_value")
            for f in factors]


def _product_factors(kernel):
    if isinstance(kernel, sk.Product):
        return _product_factors(kernel.k1) + _product_factors(kernel.k2)
    return [kernel]


def _check_layout(kernel, reader):
    """Our numbering of the free hyperparameters must be scikit-learn's theta order (k1's before
    k2's, alphabetical within a kernel); checked on the values rather than assumed."""
    ordered = sorted(reader.order, key=lambda entry: entry[2])
    ours = np.concatenate([np.log(np.atleast_1d(np.asarray(getattr(k, name), np.float64)))
                           for k, name, _, _ in ordered]) if ordered else np.zeros(0)
    if ours.shape != kernel.theta.shape or not np.allclose(ours, kernel.theta, rtol=0,
                                                           atol=1e-12):
        raise AssertionError(f"internal: hyperparameters of {kernel!r} read out of theta order")


def check_alpha(alpha, n: int | None = None):
    """scikit-learn's ``alpha`` checked: a float, or a float64 array of one value per training
    point (``n`` of them when ``n`` is given; a one-element array is a scalar, as in
    scikit-learn), every value real, finite and non-negative."""
    value = _floats(alpha)
    if value is None or value.ndim > 1 or not np.all(np.isfinite(value) & (value >= 0)):
        raise ValueError(
            "alpha must be a non-negative number, or an array of them with one entry per "
            f"training point (the values added to the kernel matrix's diagonal), got {alpha!r:.200}"
        )
    if value.ndim == 0:
        return float(value)
    if n is not None and value.shape[0] != n:
        if value.shape[0] == 1:
            return float(value[0])
        raise ValueError(
            "alpha must be a scalar or an array with same number of entries as y. "
            f"({value.shape[0]} != {n}): one value per training point"
        )
    return value.copy()


def kernel_spec(kernel, alpha, d: int) -> KernelSpec | None:
    """The estimator's ``kernel`` as a checked `KernelSpec` for ``d`` features (None for
    ``kernel=None``, the default model); ``alpha``'s form is checked too (`check_alpha`, its
    length only at fit)."""
    check_alpha(alpha)
    if kernel is None:
        return None
    spec = KernelSpec.from_sklearn(kernel)
    for node in _nodes(spec.kernel):
        for name, param in node.params:
            if not param.scalar and param.size != d:
                raise ValueError(
                    f"{node.cls.__name__} has {param.size} lengthscales but X has {d} features:"
                    f" give one per feature, or a single number")
    return spec


def _nodes(node):
    if isinstance(node, _Combination):
        return [leaf for term in node.terms for leaf in _nodes(term)]
    return [node]
