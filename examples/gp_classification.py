"""GP classification of iris species from two sepal measurements with ScalableGPClassifier.

Data: the iris flowers of R. A. Fisher (1936), 150 flowers of three species (50 each), from the
UCI Machine Learning Repository (CC BY 4.0), as scikit-learn ships them
(``sklearn.datasets.load_iris``, nothing downloaded). Two features, sepal length and width (cm),
keep the task hard enough to tell models apart (versicolor and virginica overlap) and let the
class probabilities be drawn over the plane.

Prints held-out accuracy and log-loss of ScalableGPClassifier (the default model: an ARD RBF
kernel with a learnt outputscale, one-vs-rest) next to scikit-learn's
GaussianProcessClassifier with the same kernel, saves the model to a safe file and checks that
the loaded copy predicts the same probabilities, and draws the class probabilities (each
species a colour) with the data to a PNG (needs matplotlib; skipped without it). Exits non-zero
when scalegp is clearly worse than scikit-learn or the saved model predicts differently.

    python examples/gp_classification.py --plot gp_classification.png
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sklearn.datasets import load_iris
from sklearn.gaussian_process import GaussianProcessClassifier
from sklearn.gaussian_process.kernels import RBF, ConstantKernel
from sklearn.metrics import accuracy_score, log_loss
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from scalegp import ScalableGPClassifier
from scalegp.persistence import load_model, save_model


def plot(path, model, x, y, names, features):
    """Each species' probability as the strength of its colour over the plane, the most
    probable species' boundaries, and the data."""
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'scalegp[plot]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lo, hi = x.min(axis=0) - 0.5, x.max(axis=0) + 0.5
    u, v = np.meshgrid(np.linspace(lo[0], hi[0], 120), np.linspace(lo[1], hi[1], 120))
    proba = model.predict_proba(np.column_stack([u.ravel(), v.ravel()]))
    colours = np.array([[0.85, 0.3, 0.2], [0.2, 0.6, 0.3], [0.25, 0.35, 0.85]])
    image = (proba @ colours).reshape(u.shape + (3,))
    fig, ax = plt.subplots(figsize=(6.5, 5))
    ax.imshow(image, origin="lower", extent=(lo[0], hi[0], lo[1], hi[1]), aspect="auto",
              alpha=0.6)
    for k, name in enumerate(names):
        ax.scatter(*x[y == k].T, color=colours[k], edgecolor="k", s=22, label=name)
    ax.contour(u, v, proba.argmax(axis=1).reshape(u.shape), levels=[0.5, 1.5], colors="k",
               linewidths=0.7)
    ax.set(xlabel=features[0], ylabel=features[1],
           title="ScalableGPClassifier: class probabilities and decision boundaries")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=None,
                        help="save the class probabilities here (PNG; needs matplotlib)")
    args = parser.parse_args()

    iris = load_iris()
    x, y = iris.data[:, :2], iris.target
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, stratify=y,
                                                        random_state=0)
    models = {
        "scalegp ScalableGPClassifier": make_pipeline(
            StandardScaler(), ScalableGPClassifier(random_state=0)),
        "sklearn GaussianProcessClassifier": make_pipeline(
            StandardScaler(), GaussianProcessClassifier(
                ConstantKernel(1.0, (1e-5, 1e5)) * RBF(np.ones(2), (1e-5, 1e5)),
                random_state=0)),
    }
    scores = {}
    for name, model in models.items():
        start = time.perf_counter()
        model.fit(x_train, y_train)
        proba = model.predict_proba(x_test)
        elapsed = time.perf_counter() - start
        scores[name] = (accuracy_score(y_test, model.predict(x_test)), log_loss(y_test, proba))
        print(f"{name:34s} accuracy {scores[name][0]:.3f}  log-loss {scores[name][1]:.4f}  "
              f"({elapsed:.1f} s, n_train={len(y_train)}, 3 classes)")

    ours, theirs = scores.values()
    failed = []
    if ours[0] < theirs[0] - 0.1 or ours[1] > theirs[1] + 0.1:
        failed.append("scalegp is clearly worse than scikit-learn")

    model = models["scalegp ScalableGPClassifier"]
    with tempfile.TemporaryDirectory() as folder:
        path = save_model(model, Path(folder) / "iris.npz",
                          metadata={"features": iris.feature_names[:2]})
        loaded = load_model(path, expect="classifier")
        same = np.array_equal(loaded.predict_proba(x_test), model.predict_proba(x_test))
        print(f"saved and loaded ({path.stat().st_size:,} bytes): "
              f"{'the same' if same else 'DIFFERENT'} probabilities")
    if not same:
        failed.append("the loaded model predicts other probabilities")
    if args.plot is not None:
        plot(args.plot, model, x, y, iris.target_names, iris.feature_names[:2])
    if failed:
        print("FAILED: " + "; ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
