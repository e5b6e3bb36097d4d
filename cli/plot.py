"""``replicafit plot``: history.png of a run directory, one panel per quantity, the best epoch marked."""

from __future__ import annotations

import csv
import json
import math
import os

from .parser import UsageError
from .reports import first_best, format_number

__all__ = ["plot", "plot_spec", "draw"]


def plot(args) -> int:
    """``replicafit plot RUN_DIR``: draws RUN_DIR/history.png from history.csv (needs matplotlib).

    Example::

        status = plot(build_parser().parse_args(["plot", "runs/mine"]))  # prints "wrote runs/mine/history.png"
    """
    if not os.path.exists(os.path.join(args.run_dir, "history.csv")):
        raise UsageError(f"{args.run_dir} has no history.csv: is it a run directory of `replicafit fit`?")
    if plot_spec(args.run_dir) is None:
        raise UsageError(f"{os.path.join(args.run_dir, 'history.csv')} holds no epoch yet: nothing to draw")
    if not draw(args.run_dir):
        raise UsageError("plotting needs matplotlib: pip install 'replicafit[plot]'")
    print(f"wrote {os.path.join(args.run_dir, 'history.png')}")
    return 0


def _column(rows, name: str) -> list:
    return [float(r[name]) if r.get(name) not in (None, "") else math.nan for r in rows]


def plot_spec(run_dir: str) -> dict | None:
    """What history.png shows (None for a history without epochs): a title (the recipe's name and the
    run directory's), one panel per quantity (loss and each metric, train and validation values per
    epoch, axis labels) and the best epoch of the monitored metric, marked on its panel: metrics.json's
    ``best`` (the EarlyStopping's monitor, else val_loss or loss, what best.pt keeps), or for a run
    directory without one, the first minimum of val_loss (loss without validation).

    Example::

        spec = plot_spec("runs/mine")
        [panel["name"] for panel in spec["panels"]], spec["best"]["label"]  # ['loss', 'accuracy'], 'best val_loss: ...'
    """
    with open(os.path.join(run_dir, "history.csv"), newline="") as file:
        rows = list(csv.DictReader(file))
    if not rows:
        return None
    try:
        with open(os.path.join(run_dir, "metrics.json")) as file:
            metrics = json.load(file)
    except (OSError, ValueError):
        metrics = {}
    epochs = [int(r["epoch"]) + 1 for r in rows]
    names = [k for k in rows[0] if k not in ("epoch", "learning_rate") and not k.startswith("val_")]
    names.sort(key=lambda name: name != "loss")  # the loss first (history.csv orders its columns by name)
    panels = []
    for name in names:
        series = {"train": _column(rows, name)}
        if f"val_{name}" in rows[0]:
            series["validation"] = _column(rows, f"val_{name}")
        panels.append({"name": name, "xlabel": "epoch", "ylabel": name, "series": series})
    best = metrics.get("best") if isinstance(metrics.get("best"), dict) else None
    if best is None:
        monitor = "val_loss" if "val_loss" in rows[0] else "loss"
        best = first_best(epochs, monitor, _column(rows, monitor)) if monitor in rows[0] else None
    mark = None
    if best is not None and best["monitor"].removeprefix("val_") in names:
        mark = {
            "panel": best["monitor"].removeprefix("val_"),
            "series": "validation" if best["monitor"].startswith("val_") else "train",
            "epoch": best["epoch"],
            "value": best["value"],
            "label": f"best {best['monitor']}: {format_number(best['value'])} (epoch {best['epoch']})",
        }
    run_name = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    recipe = metrics.get("recipe")
    return {
        "title": f"recipe {recipe}, run {run_name}" if recipe else f"run {run_name}",
        "epochs": epochs,
        "panels": panels,
        "best": mark,
    }


def draw(run_dir: str) -> bool:
    """history.png from ``plot_spec``. False without matplotlib (or without an epoch to draw).

    Example::

        if not draw("runs/mine"):
            print("pip install 'replicafit[plot]' for history.png")
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    spec = plot_spec(run_dir)
    if spec is None:
        return False
    panels, mark = spec["panels"], spec["best"]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False, layout="constrained")
    figure.suptitle(spec["title"])
    for axis, panel in zip(axes[0], panels):
        for label, values in panel["series"].items():
            axis.plot(spec["epochs"], values, label=label)
        if mark is not None and mark["panel"] == panel["name"]:
            axis.axvline(mark["epoch"], color="gray", linestyle=":", linewidth=1)
            axis.plot([mark["epoch"]], [mark["value"]], "r*", markersize=12, label=mark["label"])
        axis.set_xlabel(panel["xlabel"])
        axis.set_ylabel(panel["ylabel"])
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend()
    figure.savefig(os.path.join(run_dir, "history.png"), dpi=100)
    plt.close(figure)
    return True
