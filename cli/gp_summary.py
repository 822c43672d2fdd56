"""The text summaries of `scalegp gp fit`, `predict` and `sample` (their ``--json`` output is the
dict these format)."""

from __future__ import annotations


def format_fit(s: dict) -> str:
    def numbers(values):
        values = values if isinstance(values, list) else [values]
        return ", ".join(f"{v:.4g}" for v in values)

    lines = [
        f"data:        {s['data']}  ({s['train_points']:,} training"
        + (f", {s['test_points']:,} held-out" if s["test_points"] else "") + " points)",
        f"features:    {', '.join(s['features'])}  ->  target: {s['target']}",
    ]
    if s["rows_dropped"]:
        lines.append(f"dropped:     {s['rows_dropped']} rows with missing values")
    if "classes" in s:
        return "\n".join(lines + _classifier_lines(s))
    lines += [
        f"solver:      {s['solver']} ({s['dtype']}), {s['optimizer_iterations']} optimiser "
        "iterations",
    ]
    if "kernel" in s:
        lines.append(f"kernel:      {s['kernel']}  (lengthscales in {s['lengthscale_units']}, "
                     f"variances in {s['target_units']} units)")
    else:
        lines += [
            f"lengthscale: {numbers(s['lengthscale'])}  (in {s['lengthscale_units']})",
            f"outputscale: {numbers(s['outputscale'])}, noise variance: {numbers(s['noise'])}  "
            f"(in {s['target_units']} units)",
        ]
    lines += [
        f"mean:        {numbers(s['mean'])}  (in target units)",
        "log marginal likelihood: " + (
            "not evaluated (no step on all data)" if s["log_marginal_likelihood"] is None
            else f"{s['log_marginal_likelihood']:.6g}"),
    ]
    if "test_rmse" in s:
        lines.append(f"held-out RMSE: {s['test_rmse']:.6g}  (predicting the training mean: "
                     f"{s['test_rmse_of_train_mean']:.6g});  NLL per point: {s['test_nll']:.4f}")
    return "\n".join(lines + _written_lines(s))


def _classifier_lines(s: dict) -> list[str]:
    classes = ", ".join(map(str, s["classes"][:10])) + (", ..." if len(s["classes"]) > 10 else "")
    lines = [
        f"classes:     {classes}  ({len(s['classes'])})",
        f"solver:      {s['solver']} ({s['dtype']}), {s['optimizer_iterations']} Laplace "
        "objective evaluations",
        (f"kernel:      {s['kernel'][0]}" if len(s["kernel"]) == 1 else "kernels:    ")
        + f"  (lengthscales in {s['lengthscale_units']})",
    ]
    if len(s["kernel"]) > 1:
        lines += [f"  {label} vs rest: {kernel}"
                  for label, kernel in zip(s["classes"], s["kernel"])]
    lines.append(f"log marginal likelihood: {s['log_marginal_likelihood']:.6g}")
    if "test_accuracy" in s:
        lines.append(f"held-out accuracy: {s['test_accuracy']:.4f}  (majority class: "
                     f"{s['test_accuracy_of_majority_class']:.4f});  log-loss: "
                     f"{s['test_log_loss']:.4f}  (class frequencies: "
                     f"{s['test_log_loss_of_class_frequencies']:.4f})")
    return lines + _written_lines(s)


def _written_lines(s: dict) -> list[str]:
    lines = [f"wrote plot:  {s['plot']}"] if "plot" in s else []
    if "model" in s:
        lines.append(f"wrote model: {s['model']}")
    return lines + [f"time:        {s['seconds']:.2f} s (fit {s['fit_seconds']:.2f} s)"]


def format_sample(s: dict) -> str:
    return (f"drew {s['samples']:,} samples at {s['points']:,} points with {s['model']}"
            + (f"; wrote {s['output']}" if s["output"] else "") + f" ({s['seconds']:.2f} s)")


def format_predict(s: dict) -> str:
    return (f"predicted {s['points']:,} points with {s['model']}"
            + (f"; wrote {s['output']}" if s["output"] else "") + f" ({s['seconds']:.2f} s)")
