"""Recipes mean what the trainer means: ``accuracy`` (a name or ``{type: accuracy}``) is resolved from the
shapes as in ``Trainer(metrics=["accuracy"])``, Keras' exact-equality ``Accuracy`` is ``exact_match``."""

from __future__ import annotations

import csv
import os
import re
import textwrap
import uuid

import pytest
import torch

from replicafit.trainer import Trainer, cli, metrics, recipes
from replicafit.trainer.registry import REGISTRIES

pytestmark = pytest.mark.timeout(120)

RECIPE = """
seed: 0
strategy: one_device
data:
  type: classification
  n_samples: 64
  n_features: 4
  n_classes: 2
  validation_split: 0.25
model:
  type: mlp
  hidden: [8]
optimizer:
  type: sgd
  learning_rate: 0.1
loss: cross_entropy
metrics: METRICS
fit:
  epochs: 2
  batch_size: 16
  verbose: 0
"""


def write(tmp_path, text: str):
    path = tmp_path / f"recipe_{uuid.uuid4().hex[:8]}.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def history(run_dir) -> list:
    with open(os.path.join(run_dir, "history.csv"), newline="") as file:
        return list(csv.DictReader(file))


# --- accuracy in a recipe ------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["{type: accuracy}", "{type: acc}", "acc"])
def test_accuracy_as_a_mapping_is_resolved_from_the_shapes_as_the_name_is(tmp_path, capsys, spelling):
    """Integer labels against two logits: sparse categorical accuracy, not the exact-equality metric."""
    reference = write(tmp_path, RECIPE.replace("METRICS", "[accuracy]"))
    path = write(tmp_path, RECIPE.replace("METRICS", f"[{spelling}]"))
    assert run_cli(capsys, "validate", path)[0] == 0
    assert recipes.build(recipes.load(path)).trainer._metric_specs == ["accuracy"]
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert "Traceback" not in err and "validation accuracy:" in out
    assert run_cli(capsys, "fit", reference, "--run-dir", tmp_path / "reference")[0] == 0
    assert history(tmp_path / "run") == history(tmp_path / "reference")


def test_crossentropy_as_a_mapping_is_resolved_as_the_name_is(tmp_path, capsys):
    path = write(tmp_path, RECIPE.replace("METRICS", "[{type: crossentropy}, {type: ce}]"))
    run = recipes.build(recipes.load(path))
    assert run.trainer._metric_specs == ["crossentropy", "crossentropy"]


def test_accuracy_takes_no_arguments_and_the_message_names_the_fixed_kinds(tmp_path, capsys):
    path = write(tmp_path, RECIPE.replace("METRICS", "[{type: accuracy, threshold: 0.0}]"))
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2 and "Traceback" not in err
    assert re.search(r"metrics\[0\]\.threshold: 'accuracy' takes no arguments", err), err
    assert "binary_accuracy (threshold)" in err and "exact_match" in err


def test_exact_match_is_keras_accuracy_class_by_its_own_name(tmp_path, capsys):
    assert REGISTRIES["metric"].get("exact_match") is metrics.Accuracy
    assert REGISTRIES["metric"].get("accuracy") == "accuracy"  # a name the trainer resolves
    metric = metrics.get("exact_match")
    assert type(metric) is metrics.Accuracy and metric.name == "exact_match"
    status, out, _ = run_cli(capsys, "list", "metric")
    assert status == 0 and re.search(r"^\s+exact_match\s+How often ``y_pred`` equals ``y_true`` exactly", out, re.M)
    path = write(tmp_path, RECIPE.replace("METRICS", "[exact_match, {type: exact_match, name: same}]"))
    assert run_cli(capsys, "validate", path)[0] == 0
    specs = recipes.build(recipes.load(path)).trainer._metric_specs
    assert [(type(m), m.name) for m in specs] == [(metrics.Accuracy, "exact_match"), (metrics.Accuracy, "same")]


def test_exact_match_against_scores_says_to_use_accuracy():
    metric = metrics.get("exact_match")
    with pytest.raises(ValueError, match=r"labels of shape \[2\] and predictions of shape \[2, 3\].*'accuracy'"):
        metric.update_state(torch.tensor([0, 2]), torch.randn(2, 3))
    trainer = Trainer(optimizer="sgd", loss="mse", metrics=["exact_match"])
    x = torch.arange(8.0).reshape(8, 1)
    trainer.fit(torch.nn.Linear(1, 1), (x, x), batch_size=4, verbose=0)
    assert "exact_match" in trainer.evaluate(torch.nn.Identity(), (x, x), batch_size=4, verbose=0, return_dict=True)
