import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from typer.testing import CliRunner

from scalegp import ScalableGPRegressor
from scalegp.cli import gp as gp_command
from scalegp.cli.app import app
from scalegp.persistence import load_model

runner = CliRunner()
FAST = ["--max-iter", "15"]


def invoke(*args):
    return runner.invoke(app, ["gp", *map(str, args)])


@pytest.fixture
def table(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(-3, 3, size=(80, 2)) * [1.0, 20.0]
    y = np.sin(x[:, 0]) + 0.05 * x[:, 1] + 0.1 * rng.normal(size=80)
    path = tmp_path / "train.csv"
    lines = ["id,a,b,target"] + [f"p{i},{a:.17g},{b:.17g},{t:.17g}" for i, (a, b, t) in
                                 enumerate(zip(x[:, 0], x[:, 1], y))]
    path.write_text("\n".join(lines) + "\n")
    return path, x, y


def test_fit_reports_hyperparameters_and_held_out_error(table, tmp_path):
    path, x, y = table
    result = invoke("fit", path, "--target", "target", "--features", "a,b", "--test-size", 0.25,
                    *FAST)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "60 training, 20 held-out points" in out and "a, b  ->  target: target" in out
    assert "solver:      exact (float32)" in out and "lengthscale: " in out
    rmse = float(out.split("held-out RMSE: ")[1].split()[0])
    baseline = float(out.split("training mean: ")[1].split(")")[0])
    assert rmse < 0.5 * baseline


def test_fit_without_steps_on_all_data_leaves_the_nlml_unevaluated(table, tmp_path):
    """BBMM without steps on all data: the summary says so instead of paying for the NLML."""
    path, _, _ = table
    result = invoke("fit", path, "--target", "target", "--features", "a,b", "--solver", "bbmm",
                    "--max-iter-full", 0, "--json", *FAST)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["log_marginal_likelihood"] is None
    result = invoke("fit", path, "--target", "target", "--features", "a,b", "--solver", "bbmm",
                    "--max-iter-full", 0, *FAST)
    assert "log marginal likelihood: not evaluated (no step on all data)" in result.stdout


def test_full_data_tol_reaches_the_regressor_and_is_refused_with_classify(table, tmp_path):
    path, _, _ = table
    model = tmp_path / "gp.npz"
    result = invoke("fit", path, "--target", "target", "--features", "a,b", "--solver", "bbmm",
                    "--full-data-tol", 0.01, "--model", model, "--max-iter-full", 0, *FAST)
    assert result.exit_code == 0, result.output
    assert load_model(model)[-1].get_params()["full_data_tol"] == 0.01
    result = invoke("fit", path, "--target", "target", "--classify", "--full-data-tol", 0.01)
    assert result.exit_code != 0 and "--full-data-tol applies to regression" in result.output


def test_fit_then_predict_reproduces_the_python_api(table, tmp_path):
    path, x, y = table
    model = tmp_path / "gp.npz"
    result = invoke("fit", path, "--target", "target", "--features", "a,b", "--model", model,
                    "--json", *FAST)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["model"] == str(model) and summary["features"] == ["a", "b"]

    query = tmp_path / "query.csv"
    query.write_text("b,a\n" + "\n".join(f"{b:.17g},{a:.17g}" for a, b in x[:9] + 0.3) + "\n")
    out = tmp_path / "pred.csv"
    result = invoke("predict", model, query, "--std", "--out", out)
    assert result.exit_code == 0, result.output
    assert f"predicted 9 points with {model}; wrote {out}" in result.stdout
    predicted = np.loadtxt(out, delimiter=",", skiprows=1)
    assert out.read_text().startswith("mean,std\n")

    # the columns were matched by name (the query has them in the other order)
    api = make_pipeline(StandardScaler(), ScalableGPRegressor(
        normalize_y=True, dtype="float32", max_iter=15, random_state=0)).fit(x, y)
    mean, std = api.predict(x[:9] + 0.3, return_std=True)
    np.testing.assert_allclose(predicted[:, 0], mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(predicted[:, 1], std, rtol=1e-6, atol=1e-6)
    loaded = load_model(model)
    np.testing.assert_allclose(loaded.predict(x[:9] + 0.3), mean, rtol=1e-6, atol=1e-6)


def test_predict_to_stdout_and_y_file(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(40, 3)), rng.normal(size=40)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    model = tmp_path / "m.npz"
    result = invoke("fit", tmp_path / "x.npy", "--y", tmp_path / "y.npy", "--no-standardize",
                    "--float64", "--model", model, "--quiet", *FAST)
    assert result.exit_code == 0 and result.stdout == "", result.output
    result = invoke("predict", model, tmp_path / "x.npy")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "mean" and len(lines) == 41
    np.testing.assert_allclose([float(v) for v in lines[1:]], load_model(model).predict(x),
                               rtol=1e-8)


def test_tampered_model_is_rejected(table, tmp_path):
    path, _, _ = table
    model = tmp_path / "gp.npz"
    assert invoke("fit", path, "--target", "target", "--features", "a,b", "--model", model,
                  *FAST).exit_code == 0
    with np.load(model, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    arrays["1.alpha_"] = arrays["1.alpha_"] + 1e-3
    np.savez(model, **arrays)
    out = tmp_path / "pred.npy"
    result = invoke("predict", model, path, "--columns", "a,b", "--out", out)
    assert result.exit_code == 2 and "checksum mismatch" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    ([], "exactly one of --target COLUMN or --y FILE"),
    (["--target", "nope", "--features", "a"], "no column 'nope'"),
    (["--target", "target"], "column 'id' is not numeric (line 2: 'p0'); choose numeric columns "
                             "with --features"),
    (["--target", "target", "--features", "a,target"], "both the target and a feature"),
    (["--target", "target", "--features", "a", "--test-size", "1.5"], "--test-size must be in"),
    (["--target", "target", "--features", "a", "--solver", "svd"], "--solver must be one of"),
    (["--target", "target", "--features", "a", "--model", "m.pkl"], "ending in .npz"),
    (["--target", "target", "--features", ""], "--features '' has an empty name"),
    (["--target", "target", "--features", "a,,b"], "e.g. --features x,y"),
])
def test_fit_bad_input(table, args, message):
    result = invoke("fit", table[0], *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output


def test_constant_target_is_a_clear_error(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("x,y\n" + "\n".join(f"{i},1.0" for i in range(10)) + "\n")
    result = invoke("fit", path, "--target", "y", *FAST)
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


def test_predict_bad_input(table, tmp_path):
    path, _, _ = table
    model = tmp_path / "gp.npz"
    assert invoke("fit", path, "--target", "target", "--features", "a,b", "--model", model,
                  *FAST).exit_code == 0
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.ones((3, 5)))
    result = invoke("predict", model, wrong)
    assert result.exit_code == 2 and "gives 5 feature columns, the model needs 2" in result.stderr
    result = invoke("predict", tmp_path / "none.npz", wrong)
    assert result.exit_code == 2 and "does not exist" in result.stderr
    result = invoke("predict", model, path, "--columns", "a,b", "--out", path, "--force")
    assert result.exit_code == 2 and "is an input file" in result.stderr
    result = invoke("predict", wrong, path)
    assert result.exit_code == 2 and "single array, not a scalegp model" in result.stderr


def test_predict_into_a_closed_pipe_stops_quietly(table, tmp_path):
    path, x, _ = table
    np.save(tmp_path / "x.npy", x)
    model = tmp_path / "gp.npz"
    assert invoke("fit", path, "--target", "target", "--features", "a,b", "--model", model,
                  *FAST).exit_code == 0
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written, as after head -1
    try:
        result = subprocess.run(
            [sys.executable, "-m", "scalegp", "gp", "predict", str(model),
             str(tmp_path / "x.npy")], stdout=write_end, stderr=subprocess.PIPE, text=True,
            timeout=120)
    finally:
        os.close(write_end)
    assert result.returncode == 1 and result.stderr == ""


SLOW_MODEL_WRITE = """
import os, sys, time
from scalegp.cli.app import app

def slow_replace(*args):  # the model file is half-way written when this is called
    print("writing", flush=True)
    time.sleep(120)

os.replace = slow_replace
app(sys.argv[1:], prog_name="scalegp")
"""


def test_sigterm_during_the_model_write_leaves_no_files(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.normal(size=(20, 2)))
    np.save(tmp_path / "y.npy", rng.normal(size=20))
    model = tmp_path / "gp.npz"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_MODEL_WRITE, "gp", "fit", str(tmp_path / "x.npy"), "--y",
         str(tmp_path / "y.npy"), "--max-iter", "1", "--model", str(model), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "writing\n", proc.stderr.read()
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + 15  # as a shell reports death by SIGTERM
    finally:
        proc.kill()
        proc.communicate()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.npy", "y.npy"]


@pytest.fixture
def fitted(table, tmp_path):
    path, x, _ = table
    model = tmp_path / "gp.npz"
    result = invoke("fit", path, "--target", "target", "--features", "a,b", "--model", model,
                    *FAST)
    assert result.exit_code == 0, result.output
    return model, x


def test_predict_refuses_columns_with_other_names(fitted, tmp_path):
    model, x = fitted
    query = tmp_path / "q.csv"
    query.write_text("c,d\n" + "\n".join(f"{a:.17g},{b:.17g}" for a, b in x[:4]) + "\n")
    result = invoke("predict", model, query)
    assert result.exit_code == 2
    assert "no column 'a', 'b'; the model was trained on a, b" in result.stderr
    assert "--by-position" in result.stderr
    result = invoke("predict", model, query, "--by-position")
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose([float(v) for v in result.stdout.splitlines()[1:]],
                               load_model(model).predict(x[:4]), rtol=1e-6)


def test_predict_needs_a_model_that_predicts(table, tmp_path):
    from scalegp.persistence import save_model

    model = save_model(StandardScaler().fit(table[1]), tmp_path / "scaler.npz")
    result = invoke("predict", model, table[0], "--columns", "a,b")
    assert result.exit_code == 2 and "this model cannot predict" in result.stderr


def test_signed_models_need_their_key(table, tmp_path):
    path, x, _ = table
    model = tmp_path / "gp.npz"
    args = ["fit", path, "--target", "target", "--features", "a,b", "--model", model, *FAST]
    signed = {"SCALEGP_MODEL_KEY": "s3cret"}
    assert runner.invoke(app, ["gp", *map(str, args)], env=signed).exit_code == 0
    predict = ["gp", "predict", str(model), str(path), "--columns", "a,b"]
    assert runner.invoke(app, predict, env=signed).exit_code == 0
    for env, message in [({"SCALEGP_MODEL_KEY": None}, "is signed; load it with its key"),
                         ({"SCALEGP_MODEL_KEY": "guess"}, "signature does not match this key"),
                         ({"SCALEGP_MODEL_KEY": ""}, "SCALEGP_MODEL_KEY is set but empty")]:
        result = runner.invoke(app, predict, env=env)
        assert result.exit_code == 2 and message in result.stderr, result.output


def test_a_key_that_is_not_utf8_is_refused_before_any_work(table, tmp_path, monkeypatch):
    # $'\xff' once failed with a codec message naming no variable, and in gp fit after the fit
    from scalegp.cli import gp

    def no_fit(*args):
        raise AssertionError("fitted with a key that cannot sign")

    monkeypatch.setattr(gp, "_fit_with_progress", no_fit)
    monkeypatch.setenv("SCALEGP_MODEL_KEY", os.fsdecode(b"s3\xffcret"))  # as the shell sets it
    path, model = table[0], tmp_path / "gp.npz"
    fit = invoke("fit", path, "--target", "target", "--features", "a,b", "--model", model)
    np.save(model, np.ones(3))  # predict checks the key before it reads the model
    for result in (fit, invoke("predict", model, path)):
        assert result.exit_code == 2, result.output
        assert ("SCALEGP_MODEL_KEY is not UTF-8 text (byte 0xff at position 2)"
                in result.stderr), result.stderr

def test_malformed_model_files_are_bad_input(fitted, table):
    import json

    model, _ = fitted
    with np.load(model, allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    key = "__scalegp_header__"
    header = json.loads(str(arrays.pop(key)[()]))
    header["model"]["steps"][0] = "scale"
    np.savez(model, **{key: np.array(json.dumps(header))}, **arrays)
    result = invoke("predict", model, table[0])
    assert result.exit_code == 2 and "steps[0]: expected an object" in result.stderr


PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--kernel", "rbf - rq"], "--kernel: '-' in 'rbf - rq' is not allowed; combine terms with + "
                               "and * only"),
    (["--kernel", "rbf.__class__"], "--kernel: 'rbf.__class__' is not allowed"),
    (["--kernel", "gauss"], "unknown term 'gauss'; the terms are rbf, matern12"),
    (["--kernel", ""], "--kernel: the formula is empty"),
    (["--kernel", "rbf", "--lengthscale", "2"], "--lengthscale sets the default model's "
                                                "lengthscale; with --kernel give lengthscales"),
])
def test_bad_kernel_is_refused_before_reading_the_data(tmp_path, args, message):
    result = invoke("fit", tmp_path / "absent.csv", "--target", "y", *args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


@pytest.fixture
def one_feature(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 6, size=50)
    y = np.sin(x) + 0.1 * rng.normal(size=50)
    path = tmp_path / "wave.csv"
    path.write_text("t,y\n" + "".join(f"{a:.17g},{b:.17g}\n" for a, b in zip(x, y)))
    return path


def test_fit_with_a_kernel_formula(one_feature, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fit.png"
    args = ["fit", one_feature, "--target", "y", "--test-size", 0.2,
            "--kernel", "rbf + 0.5*rbf*periodic(period=2) + rq", "--plot", png, *FAST]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    assert "kernel:      " in result.stdout and "lengthscale: " not in result.stdout
    assert "RBF(" in result.stdout and "RationalQuadratic(" in result.stdout
    assert png.read_bytes()[:8] == PNG
    summary = json.loads(invoke(*args, "--json", "--force").stdout)
    assert "ExpSineSquared(" in summary["kernel"]
    assert "lengthscale" not in summary
    assert summary["test_rmse"] < 0.5 * summary["test_rmse_of_train_mean"]


def test_kernel_model_round_trip(one_feature, tmp_path):
    from scalegp.cli.kernel_spec import parse_kernel

    formula = "rbf + 0.5*rbf*periodic(period=2) + matern32(lengthscale=2)"
    model, out = tmp_path / "gp.npz", tmp_path / "pred.npy"
    result = invoke("fit", one_feature, "--target", "y", "--kernel", formula, "--model", model,
                    "--json", *FAST)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    loaded = load_model(model)
    gp = loaded[-1]
    assert gp.kernel == parse_kernel(formula) and summary["kernel"] == str(gp.kernel_)
    assert gp._spec is not None and not hasattr(gp, "lengthscale_")

    query = tmp_path / "query.csv"
    grid = np.linspace(-1, 7, 11)
    query.write_text("t\n" + "".join(f"{t:.17g}\n" for t in grid))
    result = invoke("predict", model, query, "--std", "--out", out)
    assert result.exit_code == 0, result.output
    predicted = np.load(out)
    mean, std = loaded.predict(grid[:, None], return_std=True)
    np.testing.assert_array_equal(predicted[:, 0], mean)
    np.testing.assert_array_equal(predicted[:, 1], std)
    assert np.all(std > 0) and np.all(np.isfinite(mean))


def test_plot_draws_one_feature_fits(one_feature, tmp_path):
    pytest.importorskip("matplotlib")
    png, model = tmp_path / "fit.png", tmp_path / "gp.npz"
    result = invoke("fit", one_feature, "--target", "y", "--test-size", 0.2,
                    "--plot", png, "--model", model, "--json", *FAST)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["plot"] == str(png) and summary["model"] == str(model)
    assert png.read_bytes()[:8] == PNG and model.is_file()
    # without held-out points
    result = invoke("fit", one_feature, "--target", "y", "--plot", png, "--force", *FAST)
    assert result.exit_code == 0 and png.read_bytes()[:8] == PNG, result.output


def test_plot_refuses_two_features_before_fitting(table, tmp_path, monkeypatch):
    def no_fit(*args, **kwargs):
        raise AssertionError("fitted")

    monkeypatch.setattr(ScalableGPRegressor, "fit", no_fit)
    png = tmp_path / "fit.png"
    result = invoke("fit", table[0], "--target", "target", "--features", "a,b", "--plot", png)
    assert result.exit_code == 2
    assert result.stderr == ("error: --plot draws one-feature data; this data has 2 features "
                             "(a, b): choose one with --features\n")
    assert not png.exists()
    result = invoke("fit", table[0], "--target", "target", "--features", "a", "--plot",
                    tmp_path / "fit.jpg")
    assert result.exit_code == 2 and "--plot" in result.stderr and ".png" in result.stderr


def test_plot_without_matplotlib(one_feature, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    result = invoke("fit", one_feature, "--target", "y", "--plot", tmp_path / "fit.png")
    assert result.exit_code == 2
    assert result.stderr == "error: --plot needs matplotlib: pip install 'scalegp[plot]'\n"


def _run_with_stderr_on_a_terminal(args, env, timeout=120):
    """``scalegp ARGS`` with stderr on a pseudo-terminal and stdout a pipe; returns the exit
    code, stdout, and what the terminal received (newlines as written)."""
    pty = pytest.importorskip("pty")  # POSIX only
    import fcntl
    import select
    import struct
    import termios

    leader, follower = pty.openpty()
    # a terminal 100 columns wide (a new one has none, and tqdm would draw nothing)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "scalegp", *map(str, args)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower,
                            env=env)
    os.close(follower)
    shown = b""
    try:
        while True:
            if not select.select([leader], [], [], timeout)[0]:
                raise AssertionError(f"no output for {timeout} s; so far: {shown!r}")
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the process closed the terminal
                break
            if not chunk:
                break
            shown += chunk
        stdout = proc.communicate(timeout=timeout)[0]
    finally:
        proc.kill()
        os.close(leader)
    return proc.returncode, stdout.decode(), shown.decode().replace("\r\n", "\n")


@pytest.mark.parametrize("quiet", [pytest.param(False, marks=pytest.mark.slow), True])
def test_fit_on_a_terminal_reports_its_phases_on_stderr(table, tmp_path, quiet):
    """Without tqdm: lines with the elapsed time and what remains, on stderr; stdout keeps the
    results alone. --quiet: nothing."""
    no_tqdm = tmp_path / "no_tqdm" / "tqdm"
    no_tqdm.mkdir(parents=True)
    (no_tqdm / "__init__.py").write_text("raise ImportError('tqdm is not installed')\n")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(no_tqdm.parent), os.environ.get("PYTHONPATH", "")])}
    code, stdout, terminal = _run_with_stderr_on_a_terminal(
        ["gp", "fit", table[0], "--target", "target", "--features", "a,b", "--json",
         "--max-iter", "3"] + (["--quiet"] if quiet else []), env)
    assert code == 0, terminal
    assert json.loads(stdout)["train_points"] == 80
    if quiet:
        assert terminal == ""
        return
    lines = terminal.splitlines()
    assert lines[:2] == ["fitting a GP to 80 points x 2 features",
                         "exact fit (start 0): at most 3 iterations ..."], terminal
    iteration = (r"exact fit \(start 0\) iter 1: NLML \S+, CG iterations 0, \d+\.\d s, "
                 r"at most ~\d+ s left")
    assert re.match(iteration, lines[2]), terminal


def test_sample_draws_what_sample_y_draws(table, tmp_path):
    path, x, y = table
    model = tmp_path / "gp.npz"
    assert invoke("fit", path, "--target", "target", "--features", "a,b", "--model", model,
                  "--quiet", *FAST).exit_code == 0
    query = tmp_path / "query.csv"
    query.write_text("a,b\n" + "\n".join(f"{a:.17g},{b:.17g}" for a, b in x[:7] + 0.2) + "\n")
    out = tmp_path / "samples.csv"
    result = invoke("sample", model, query, "--n", "4", "--seed", "3", "--out", out)
    assert result.exit_code == 0, result.output
    assert f"drew 4 samples at 7 points with {model}; wrote {out}" in result.stdout
    assert out.read_text().startswith("sample_0,sample_1,sample_2,sample_3\n")
    drawn = np.loadtxt(out, delimiter=",", skiprows=1)
    loaded = load_model(model)  # the Pipeline: its scaler, then the regressor's sample_y
    want = loaded[-1].sample_y(loaded[:-1].transform(x[:7] + 0.2), 4, random_state=3)
    np.testing.assert_allclose(drawn, want, rtol=1e-6, atol=1e-6)
    # to stdout, the same seed, the same draws
    result = invoke("sample", model, query, "--n", "4", "--seed", "3")
    lines = result.stdout.splitlines()
    assert result.exit_code == 0 and lines[0].startswith("sample_0,") and len(lines) == 8
    np.testing.assert_allclose(np.array([[float(v) for v in line.split(",")]
                                         for line in lines[1:]]), drawn, rtol=1e-6)
    result = invoke("sample", model, query, "--n", "0")
    assert result.exit_code == 2 and "Traceback" not in result.output


@pytest.mark.parametrize("n", [10**8, 10**9])
@pytest.mark.parametrize("out", [None, "s.npy", "s.csv"])
def test_samples_beyond_memory_are_refused_before_any_draw(fitted, tmp_path, n, out):
    # once "internal error (MemoryError): Unable to allocate 763. GiB ...", exit code 1
    model, x = fitted
    np.save(tmp_path / "x.npy", x)
    before = sorted(tmp_path.iterdir())
    result = invoke("sample", model, tmp_path / "x.npy", "--n", n,
                    *([] if out is None else ["--out", tmp_path / out]))
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: --n {n}: {n:,} draws at 80 ")
    assert " bytes this process can hold " in result.stderr
    assert result.stderr.rstrip().endswith("draw fewer samples at a time (draws with other "
                                           "seeds are independent), or at fewer rows")
    assert len(result.stderr.splitlines()) == 1 and sorted(tmp_path.iterdir()) == before


def test_restarts_beyond_memory_are_refused_before_the_fit(table, monkeypatch):
    # the optimiser made 10**12 starting points first: hours, then out of memory
    path, _, _ = table
    monkeypatch.setattr(gp_command, "_fit_with_progress", lambda *a: pytest.fail("fit ran"))
    result = invoke("fit", path, "--target", "target", "--features", "a,b", "--restarts",
                    10**12)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: --restarts 1000000000000: 1,000,000,000,001 "
                                    "starting points of the optimiser need about ")
    assert len(result.stderr.splitlines()) == 1


def test_float64_leaves_the_process_in_float32(tmp_path):
    """--float64 fits and predicts in float64 (the estimator's dtype) without turning JAX's
    x64 mode on for the process."""
    import jax

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(30, 2)), rng.normal(size=30)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    model = tmp_path / "m.npz"
    result = invoke("fit", tmp_path / "x.npy", "--y", tmp_path / "y.npy", "--float64",
                    "--model", model, "--quiet", *FAST)
    assert result.exit_code == 0, result.output
    assert not jax.config.jax_enable_x64
    loaded = load_model(model)
    assert loaded[-1].dtype == "float64" and loaded[-1].alpha_.dtype == np.float64
    result = invoke("predict", model, tmp_path / "x.npy", "--json", "--out", tmp_path / "p.npy")
    assert result.exit_code == 0, result.output
    assert not jax.config.jax_enable_x64
    np.testing.assert_allclose(np.load(tmp_path / "p.npy"), loaded.predict(x), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# --classify: class labels (text or whole numbers), held-out accuracy and log-loss, --proba


def labelled_csv(path, n=200, labels=("low", "mid", "high"), seed=0):
    """Two features, an id column and a label column that depends on the first feature."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-3, 3, size=(n, 2)) * [1.0, 10.0]
    score = x[:, 0] + 0.3 * rng.normal(size=n)
    cuts = np.linspace(-3, 3, len(labels) + 1)[1:-1]
    y = np.asarray(labels)[np.digitize(score, cuts)]
    path.write_text("id,a,b,label\n" + "\n".join(
        f"p{i},{a:.17g},{b:.17g},{t}" for i, (a, b, t) in enumerate(zip(x[:, 0], x[:, 1], y)))
        + "\n")
    return path, x, y


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A three-class model fitted on text labels, with its --json summary."""
    folder = tmp_path_factory.mktemp("classify")
    path, x, y = labelled_csv(folder / "train.csv")
    model = folder / "gpc.npz"
    result = invoke("fit", path, "--target", "label", "--features", "a,b", "--classify",
                    "--test-size", 0.25, "--model", model, "--json", *FAST)
    assert result.exit_code == 0, result.output
    return model, path, x, y, json.loads(result.stdout)


def test_classify_reports_held_out_accuracy_log_loss_and_kernels(classifier):
    _, _, _, _, summary = classifier
    assert summary["task"] == "classification" and summary["classes"] == ["high", "low", "mid"]
    assert summary["train_points"] == 150 and summary["test_points"] == 50
    assert len(summary["kernel"]) == 3 and all("RBF" in k for k in summary["kernel"])
    assert summary["dtype"] == "float32" and summary["solver"] == "exact"
    # far better than the baselines: the majority class and the training class frequencies
    assert summary["test_accuracy"] > 0.8 > summary["test_accuracy_of_majority_class"]
    assert summary["test_log_loss"] < 0.6 * summary["test_log_loss_of_class_frequencies"]


def test_classify_predicts_labels_and_probabilities_as_the_loaded_model(classifier, tmp_path):
    model, path, x, _, _ = classifier
    loaded = load_model(model)
    # the training file, label column included: the model's features are taken by name
    out = tmp_path / "proba.csv"
    result = invoke("predict", model, path, "--proba", "--out", out)
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("high,low,mid\n")
    proba = np.loadtxt(out, delimiter=",", skiprows=1)
    np.testing.assert_allclose(proba, loaded.predict_proba(x), rtol=1e-12)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, rtol=1e-6)
    result = invoke("predict", model, path)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "label" and lines[1:] == loaded.predict(x).tolist()


def test_classify_integer_labels_in_text_summary_and_npy_output(tmp_path):
    path, x, y = labelled_csv(tmp_path / "t.csv", n=120, labels=(3, 7))
    model = tmp_path / "m.npz"
    result = invoke("fit", path, "--target", "label", "--features", "a,b", "--classify",
                    "--test-size", 0.2, "--model", model, *FAST)
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "classes:     3, 7  (2)" in out and "kernel:      " in out
    accuracy = float(out.split("held-out accuracy: ")[1].split()[0])
    majority = float(out.split("(majority class: ")[1].split(")")[0])
    assert accuracy > majority and "log-loss: " in out
    labels = tmp_path / "labels.npy"
    result = invoke("predict", model, path, "--out", labels)
    assert result.exit_code == 0, result.output
    predicted = np.load(labels, allow_pickle=False)
    assert predicted.dtype == np.int64 and set(predicted) <= {3, 7}
    np.testing.assert_array_equal(predicted, load_model(model).predict(x))


def test_classify_bad_targets(tmp_path):
    def fit_table(name, values, *extra):
        path = tmp_path / f"{name}.csv"
        path.write_text("x,y\n" + "\n".join(f"{i},{v}" for i, v in enumerate(values)) + "\n")
        return invoke("fit", path, "--target", "y", "--classify", *extra, *FAST)

    cases = [
        (fit_table("continuous", np.linspace(0, 1, 40)),
         "--classify: column 'y' holds numbers that are not whole (e.g. 0.025641), a "
         "continuous target; fit it without --classify"),
        (fit_table("many", range(60)),
         "--classify: column 'y' has 60 distinct values, more than the 50 classes allowed"),
        (fit_table("one", ["a"] * 20), "--classify: column 'y' holds one class ('a'); give "
                                       "labels of at least two classes"),
        (fit_table("rare", ["a"] * 30 + ["b"], "--test-size", 0.5),
         "--test-size 0.5 leaves class 'b' (1 points) without training points"),
        (fit_table("plot", ["a", "b"] * 10, "--plot", tmp_path / "p.png"),
         "--plot draws a regression fit; drop it with --classify"),
    ]
    for result, message in cases:
        assert result.exit_code == 2, result.output
        assert message in result.stderr and "Traceback" not in result.output, result.stderr


def test_predict_refuses_a_model_of_the_other_kind(classifier, fitted, tmp_path):
    regression_model, _ = fitted
    model, path, _, _, _ = classifier
    for args, message in [
        ((regression_model, path, "--columns", "a,b", "--proba"),
         "holds a ScalableGPRegressor (the last step of a Pipeline), not a classifier; give a "
         "file saved from a classifier (--proba needs a model from 'scalegp gp fit --classify')"),
        ((model, path, "--std"), "holds a ScalableGPClassifier (the last step of a Pipeline), "
                                 "not a regressor"),
        ((model, path, "--std", "--proba"), "--std is for regression models, --proba for "
                                            "classifiers; give one"),
    ]:
        result = invoke("predict", *args)
        assert result.exit_code == 2 and message in result.stderr, result.output
    result = invoke("sample", model, path)
    assert result.exit_code == 2 and "need a regression model" in result.stderr


def test_classify_labels_with_commas_are_quoted_in_csv_output(tmp_path):
    path, x, y = labelled_csv(tmp_path / "t.csv", n=80, labels=("no", "yes"))
    text = path.read_text().replace(",yes\n", ',"yes, sure"\n')
    path.write_text(text)
    model = tmp_path / "m.npz"
    assert invoke("fit", path, "--target", "label", "--features", "a,b", "--classify",
                  "--model", model, "--quiet", *FAST).exit_code == 0
    out = tmp_path / "p.csv"
    result = invoke("predict", model, path, "--proba", "--out", out)
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith('no,"yes, sure"\n')
    result = invoke("predict", model, path)
    assert result.exit_code == 0, result.output
    assert '"yes, sure"' in result.stdout.splitlines()
    assert load_model(model).classes_.tolist() == ["no", "yes, sure"]


@pytest.mark.parametrize("accelerator", ["tpu", None])
def test_an_exact_model_starts_no_accelerator_that_would_send_it_to_the_host(
        table, tmp_path, monkeypatch, accelerator):
    # decisions #63: on a TPU machine the exact solver, and its model's predictions, run on
    # the host; the command keeps JAX there (no TPU client started) for such a model only
    from scalegp import _runtime

    calls = []
    monkeypatch.setattr(_runtime, "attached_accelerator", lambda: accelerator)
    monkeypatch.setattr(_runtime, "host_only", lambda: calls.append("host_only") or True)
    path, _, _ = table
    for solver, expected in (("auto", 1), ("exact", 1), ("bbmm", 0)):
        model = tmp_path / f"{solver}.npz"
        calls.clear()
        result = invoke("fit", path, "--target", "target", "--features", "a,b", "--solver",
                        solver, "--max-iter", 0, "--max-iter-full", 0, "--model", model)
        assert result.exit_code == 0, result.output
        assert len(calls) == (expected if accelerator else 0), solver
        calls.clear()
        result = invoke("predict", model, path, "--columns", "a,b")
        assert result.exit_code == 0, result.output
        assert len(calls) == (expected if accelerator else 0), solver
