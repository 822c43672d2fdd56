import builtins
import re

import numpy as np
import pytest
from sklearn.gaussian_process.kernels import (
    RBF,
    ConstantKernel,
    ExpSineSquared,
    Kernel,
    Matern,
    RationalQuadratic,
    WhiteKernel,
)

from scalegp.cli.common import CLIError
from scalegp.cli.kernel_spec import MAX_LENGTH, TERMS, parse_kernel

C = ConstantKernel
NOISE = WhiteKernel(0.1)


@pytest.mark.parametrize("text, expected", [
    ("rbf", C(1.0) * RBF(1.0) + NOISE),
    ("rbf + 1.0*rbf*periodic(period=1) + rq",  # four terms: (a + b) + (c + d)
     (C(1.0) * RBF() + C(1.0) * RBF() * ExpSineSquared(periodicity=1.0))
     + (C(1.0) * RationalQuadratic() + NOISE)),
    ("matern12 + matern32(lengthscale=2) + matern52",
     (C() * Matern(nu=0.5) + C() * Matern(2.0, nu=1.5)) + (C() * Matern(nu=2.5) + NOISE)),
    ("matern", C() * Matern(nu=1.5) + NOISE),
    ("matern(nu=2.5, lengthscale=0.3)", C() * Matern(0.3, nu=2.5) + NOISE),
    ("rq(alpha=0.5, lengthscale=3)", C() * RationalQuadratic(3.0, alpha=0.5) + NOISE),
    ("periodic(lengthscale=2, period=7)", C() * ExpSineSquared(2.0, 7.0) + NOISE),
    ("2", C(2.0) + NOISE),  # a number alone is a constant
    ("rbf + 1", C() * RBF() + C(1.0) + NOISE),  # a constant offset term
    ("rbf*2", RBF() * C(2.0) + NOISE),  # a number factor is the outputscale: no second one
    ("3 * rbf * rq", C(3.0) * RBF() * RationalQuadratic() + NOISE),
    ("rbf * rq", C() * (RBF() * RationalQuadratic()) + NOISE),  # one outputscale per term
    ("(rbf + rq) * periodic", C() * ((RBF() + RationalQuadratic()) * ExpSineSquared()) + NOISE),
    ("2*(rbf + rq)", C(2.0) * (RBF() + RationalQuadratic()) + NOISE),
    ("rbf + (rq + periodic)",  # a parenthesised sum at the top is top-level terms
     (C() * RBF() + C() * RationalQuadratic()) + (C() * ExpSineSquared() + NOISE)),
    ("rbf + white(noise=0.5)", C() * RBF() + WhiteKernel(0.5)),  # no second noise
    ("white + rbf", WhiteKernel(0.1) + C() * RBF()),  # a bare white starts at --noise
    ("white", WhiteKernel(0.1)),
    ("rbf()", C() * RBF() + NOISE),
    ("  rbf\n +\trq  ", C() * RBF() + C() * RationalQuadratic() + NOISE),
    ("rbf(lengthscale=(2))", C() * RBF(2.0) + NOISE),
    ("1e-3*rbf(lengthscale=1e2) + 1_000", C(1e-3) * RBF(100.0) + C(1000.0) + NOISE),
])
def test_formulas(text, expected):
    kernel = parse_kernel(text)
    assert isinstance(kernel, Kernel)
    assert kernel == expected, f"{kernel!r} != {expected!r}"
    assert np.all(np.isfinite(kernel.theta))


def test_noise_sets_the_added_and_the_bare_white_term():
    assert parse_kernel("rbf", noise=0.3) == C() * RBF() + WhiteKernel(0.3)
    assert parse_kernel("rbf + white", noise=0.3) == C() * RBF() + WhiteKernel(0.3)
    assert parse_kernel("rbf + white(noise=2)", noise=0.3) == C() * RBF() + WhiteKernel(2.0)


def test_a_latent_kernel_gets_no_added_white_term():
    # gp fit --classify: the formula is the latent function's kernel, which has no target noise
    assert parse_kernel("rbf", add_noise=False) == C() * RBF()
    three = parse_kernel("rbf + rq + periodic", add_noise=False)
    assert "WhiteKernel" not in repr(three) and repr(three).count("1**2") == 3
    assert parse_kernel("rbf + white", noise=0.3, add_noise=False) == C() * RBF() + WhiteKernel(0.3)


def test_every_term_is_a_working_kernel():
    x = np.linspace(0, 1, 5)[:, None]
    for name in TERMS:
        k = parse_kernel(name)(x)
        assert k.shape == (5, 5) and np.all(np.isfinite(k)) and np.allclose(k, k.T)


@pytest.mark.parametrize("text, message", [
    ("", "the formula is empty"),
    ("   \n ", "the formula is empty"),
    ("foo", "unknown term 'foo'; the terms are rbf, matern12, matern32, matern52, matern, rq, "
            "periodic, white"),
    ("RBF", "unknown term 'RBF'"),
    ("rbf + sin(x=1)", "unknown term 'sin'"),
    ("rbf(period=1)", "rbf has no parameter 'period'; it takes lengthscale"),
    ("periodic(periodicity=1)", "it takes lengthscale, period"),
    ("matern12(nu=0.5)", "matern12 has no parameter 'nu'"),
    ("rbf(lengthscale=1, lengthscale=2)", "gives lengthscale twice"),
    ("rbf(2)", "'rbf(2)': give parameters by name, e.g. rbf(lengthscale=2)"),
    ("rbf(**{'lengthscale': 2})", "give parameters by name"),
    ("rbf(lengthscale='a')", "rbf(lengthscale=...) must be a positive finite number, got 'a'"),
    ("rbf(lengthscale=rq)", "must be a positive finite number, got rq"),
    ("rbf(lengthscale=1+1)", "must be a positive finite number, got 1+1"),
    ("rbf(lengthscale=None)", "got None"),
    ("rbf(lengthscale=True)", "got True"),
    ("rbf(lengthscale=-1)", "rbf(lengthscale=...) must be a positive finite number, got -1"),
    ("rbf(lengthscale=0)", "got 0"),
    ("rbf(lengthscale=1e999)", "got 1e999"),
    ("rq(alpha=nan)", "got nan"),
    ("matern(nu=1)", "matern(nu=...) must be one of 0.5, 1.5, 2.5, got 1"),
    ("1e999*rbf", "numbers must be positive and finite, got 1e999"),
    ("0 * rbf", "numbers must be positive and finite, got 0"),
    ("9" * 400 + "*rbf", "numbers must be positive and finite, got 999"),
    ("-1*rbf", "'-1' is not allowed: numbers must be positive"),
    ("-rbf", "'-rbf' is not allowed"),
    ("+rbf", "'+rbf' is not allowed"),
    ("rbf - rq", "'-' in 'rbf - rq' is not allowed; combine terms with + and * only"),
    ("rbf ** 2", "'**' in 'rbf ** 2' is not allowed"),
    ("rbf / 2", "'/' in 'rbf / 2' is not allowed"),
    ("rbf @ rq", "'@' in 'rbf @ rq' is not allowed"),
    ("rbf | rq", "'|' in 'rbf | rq' is not allowed"),
    ("rbf +", "'rbf +' is not a formula"),
    ("rbf rq", "is not a formula"),
    ("rbf; import os", "is not a formula"),
    ("x := 1", "is not a formula"),
    ("rbf\x00", "is not a formula"),
    ("__import__('os')", "unknown term '__import__'"),
    ("__import__('os').system('echo hi')", "is not allowed: only a term's name takes parameters"),
    ("rbf.__class__", "'rbf.__class__' is not allowed; a formula has terms (rbf, "),
    ("rbf.__class__.__subclasses__()", "only a term's name takes parameters"),
    ("rbf()()", "'rbf()()' is not allowed: only a term's name takes parameters"),
    ("(lambda: rbf)()", "only a term's name takes parameters"),
    ("'rbf'", "\"'rbf'\" is not allowed"),
    ("b'rbf'", "is not allowed"),
    ("f'{rbf}'", "is not allowed"),
    ("True * rbf", "'True' is not allowed"),
    ("1j * rbf", "'1j' is not allowed"),
    ("[rbf]", "'[rbf]' is not allowed"),
    ("rbf[0]", "'rbf[0]' is not allowed"),
    ("rbf if rq else rbf", "is not allowed"),
    ("rbf and rq", "is not allowed"),
    ("rbf < rq", "is not allowed"),
    ("lambda: 1", "is not allowed"),
    ("[x for x in ()]", "is not allowed"),
    ("0.5*white", "'0.5*white': white is the noise and must be a term on its own"),
    ("rbf*white(noise=1)", "white is the noise"),
    ("(rbf + white)*rq", "white is the noise"),
    ("white + white", "2 white terms; give at most one"),
    ("white(1)", "give parameters by name, e.g. white(noise=2)"),
    ("rbf " + "+ rbf " * 200, f"at most {MAX_LENGTH} are allowed"),
    ("(" * 240 + "rbf" + ")" * 240, "is not a formula (too many nested parentheses"),
])
def test_bad_formulas_are_one_line_errors(text, message):
    with pytest.raises(CLIError) as caught:
        parse_kernel(text)
    error = str(caught.value)
    assert error.startswith("--kernel: ") and message in error, error
    assert "\n" not in error and len(error) < 400


def test_nothing_is_evaluated(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("evaluated")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.chdir(tmp_path)
    for text in ["__import__('os').system('touch pwned')", "open('pwned', 'w')",
                 "rbf(lengthscale=__import__('os').system('touch pwned'))"]:
        with pytest.raises(CLIError):
            parse_kernel(text)
    assert parse_kernel("rbf") == C() * RBF() + NOISE
    assert list(tmp_path.iterdir()) == []


def test_long_but_allowed_formulas_parse():
    text = " + ".join(["rbf"] * 100)  # 598 characters: over the limit
    with pytest.raises(CLIError, match="at most"):
        parse_kernel(text)
    text = "+".join(["rbf"] * 120)  # 479 characters
    assert len(parse_kernel(text).theta) == 2 * 120 + 1
    text = "(" * 150 + "rbf" + ")" * 150  # nesting the parser takes
    assert parse_kernel(text) == C() * RBF() + NOISE
    assert parse_kernel("*".join(["2"] * 200) + "*rbf").theta.shape == (202,)


def test_random_token_soup_never_escapes_as_another_exception():
    tokens = ["rbf", "rq", "white", "periodic", "matern", "(", ")", "+", "*", "-", "**", "=",
              ",", "lengthscale", "period", "nu", "noise", "1", "0", "-1", "1e999", "2.5", ".",
              "'", "__import__", "[", "]", ":", "lambda", " "]
    rng = np.random.default_rng(0)
    outcomes = {"kernel": 0, "error": 0}
    for _ in range(2000):
        text = "".join(rng.choice(tokens, size=rng.integers(1, 12)))
        try:
            assert isinstance(parse_kernel(text), Kernel)
            outcomes["kernel"] += 1
        except CLIError as error:
            assert "\n" not in str(error)
            outcomes["error"] += 1
    assert outcomes["kernel"] > 0 and outcomes["error"] > 0


def _depth(kernel):
    if hasattr(kernel, "k1"):
        return 1 + max(_depth(kernel.k1), _depth(kernel.k2))
    return 0


@pytest.mark.parametrize("op", ["+", "*"])
def test_long_sums_and_products_are_built_shallow(op):
    # scikit-learn's Sum and Product evaluate their operands' bounds twice: a chain of 70 rbf
    # factors (71 levels deep with the noise) never finished fitting; balanced, it is 9 levels
    kernel = parse_kernel(op.join(["rbf"] * 70))
    assert _depth(kernel) <= 9
    assert len(kernel.theta) == (2 * 70 + 1 if op == "+" else 72)


@pytest.mark.parametrize("text, character", [
    ("ｒｂｆ", "'ｒ' (U+FF52) at character 1"),  # full-width letters: NFKC makes them 'rbf'
    ("rbf + 𝐫𝐪", "'𝐫' (U+1D42B) at character 7"),  # mathematical bold
    ("rbf(ｌengthscale=2)", "'ｌ' (U+FF4C) at character 5"),
    ("rbf * ２", "'２' (U+FF12) at character 7"),
])
def test_names_are_ascii(text, character):
    with pytest.raises(CLIError, match=re.escape(character) + ".* ASCII"):
        parse_kernel(text)


def test_formula_size_limits_reach_the_command_line(tmp_path):
    from typer.testing import CliRunner

    from scalegp.cli.app import app

    path = tmp_path / "train.csv"
    path.write_text("a,y\n" + "\n".join(f"{i},{i % 3}" for i in range(10)) + "\n")
    result = CliRunner().invoke(app, ["gp", "fit", str(path), "--target", "y",
                                      "--kernel", "*".join(["rbf"] * 40)])
    assert result.exit_code == 2, result.output
    # the estimator's limits (its outputscale is the 41st factor)
    assert "a product of 41 factors; at most 8 are allowed" in result.output
