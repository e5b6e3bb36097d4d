"""Recipes mean what the trainer means: ``accuracy`` (a name or ``{type: accuracy}``) is resolved from the
shapes as in ``Trainer(metrics=["accuracy"])``, Keras' exact-equality ``Accuracy`` is ``exact_match``; a
``module:attr`` data factory returning a map-style ``Dataset`` tells the model its input size and classes as
arrays do (a ``TensorDataset`` from its tensors, another Dataset without being scanned)."""

from __future__ import annotations

import csv
import os
import re
import uuid

import pytest
import torch
from test_recipes import run_cli
from test_recipes import write as write_named

from replicafit import recipes
from replicafit.recipes import datasets
from replicafit.recipes.registry import REGISTRIES
from replicafit.trainer import Trainer, metrics

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
    return write_named(tmp_path, text, f"recipe_{uuid.uuid4().hex[:8]}.yaml")  # several recipes per folder


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
    assert recipes.build(recipes.load(path)).trainer._compile_metrics.specs == ["accuracy"]
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert "Traceback" not in err and "validation accuracy:" in out
    assert run_cli(capsys, "fit", reference, "--run-dir", tmp_path / "reference")[0] == 0
    assert history(tmp_path / "run") == history(tmp_path / "reference")


def test_crossentropy_as_a_mapping_is_resolved_as_the_name_is(tmp_path, capsys):
    path = write(tmp_path, RECIPE.replace("METRICS", "[{type: crossentropy}, {type: ce}]"))
    run = recipes.build(recipes.load(path))
    assert run.trainer._compile_metrics.specs == ["crossentropy", "crossentropy"]


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
    specs = recipes.build(recipes.load(path)).trainer._compile_metrics.specs
    assert [(type(m), m.name) for m in specs] == [(metrics.Accuracy, "exact_match"), (metrics.Accuracy, "same")]


def test_exact_match_against_scores_says_to_use_accuracy():
    metric = metrics.get("exact_match")
    with pytest.raises(ValueError, match=r"labels of shape \[2\] and predictions of shape \[2, 3\].*'accuracy'"):
        metric.update_state(torch.tensor([0, 2]), torch.randn(2, 3))
    trainer = Trainer(optimizer="sgd", loss="mse", metrics=["exact_match"])
    x = torch.arange(8.0).reshape(8, 1)
    trainer.fit(torch.nn.Linear(1, 1), (x, x), batch_size=4, verbose=0)
    assert "exact_match" in trainer.evaluate(torch.nn.Identity(), (x, x), batch_size=4, verbose=0, return_dict=True)


# --- a map-style Dataset tells the model its sizes -------------------------------------------------------
USER_DATA = """
import numpy as np
import torch

generator = torch.Generator().manual_seed(0)
X = torch.randn(64, 5, generator=generator)
Y = (X[:, 0] > 0).long() + (X[:, 1] > 0).long()  # classes 0, 1, 2


def tensors():
    return torch.utils.data.TensorDataset(X, Y)


def arrays():
    return X.numpy(), Y.numpy()


def two_targets():
    return torch.utils.data.TensorDataset(X, X[:, :2] * 2.0)


def loader():
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=16)


def split():
    return torch.utils.data.random_split(tensors(), [48, 16], generator=torch.Generator().manual_seed(0))[0]
"""

DATA_RECIPE = """
seed: 0
data: {type: "MODULE:FACTORY"}
model: {type: mlp, hidden: [8]}
loss: LOSS
metrics: []
fit: {epochs: 1, batch_size: 16, verbose: 0}
"""


@pytest.fixture
def user_data(tmp_path, monkeypatch) -> str:
    name = f"rf_user_data_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(USER_DATA)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def data_recipe(tmp_path, module: str, factory: str, loss: str = "cross_entropy"):
    text = DATA_RECIPE.replace("MODULE", module).replace("FACTORY", factory).replace("LOSS", loss)
    return write(tmp_path, text)


@pytest.mark.parametrize("factory", ["tensors", "arrays", "loader", "split"])
def test_a_tensor_dataset_sizes_the_model_as_its_arrays_do(tmp_path, capsys, user_data, factory):
    path = data_recipe(tmp_path, user_data, factory)
    if factory == "loader":  # its batches are made already
        path.write_text(path.read_text().replace(", batch_size: 16", ""))
    model = recipes.build(recipes.load(path)).model
    assert (model[0].in_features, model[-1].out_features) == (5, 3)
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0 and "Traceback" not in err, err


def test_two_dimensional_targets_of_a_tensor_dataset_give_the_outputs(tmp_path, user_data):
    model = recipes.build(recipes.load(data_recipe(tmp_path, user_data, "two_targets", loss="mse"))).model
    assert (model[0].in_features, model[-1].out_features) == (5, 2)


class Examples(torch.utils.data.Dataset):
    """A map-style Dataset whose examples are made when asked (files to read, in real life); counts reads."""

    def __init__(self, n: int = 1000, targets: bool = True):
        self.reads, self.n = 0, n
        if targets:
            self.targets = [i % 7 for i in range(n)]  # torchvision's convention: one int label per example

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        self.reads += 1
        return torch.full((2, 3), float(index)), index % 7


def test_another_dataset_is_not_scanned_its_targets_attribute_tells_the_classes():
    data = Examples()
    info = datasets.as_info(data)
    assert (info["inputs"], info["classes"], data.reads) == (6, 7, 1)  # the first example only
    data = Examples(targets=False)
    info = datasets.as_info(data)
    assert (info["inputs"], "classes" in info, data.reads) == (6, False, 1)


def test_a_dataset_that_does_not_tell_its_classes_gets_the_fix_in_the_message(tmp_path, capsys, monkeypatch):
    name = f"rf_user_data_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n"
        "class Plain(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 8\n"
        "    def __getitem__(self, i): return torch.zeros(3), i % 2\n"
        "def make(): return Plain()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    path = data_recipe(tmp_path, name, "make")
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2 and "Traceback" not in err
    assert "the model needs 'outputs'" in err and "`targets` attribute" in err and "TensorDataset" in err


class _Base:
    def __init__(self, beta, width=1):
        self.beta, self.width = beta, width


class _PassesBeta(_Base):
    """Passes its base's required ``beta`` itself (as torchmetrics' MulticlassF1Score does)."""

    def __init__(self, **kwargs):
        super().__init__(beta=1.0, **kwargs)


def test_a_bases_required_argument_that_the_subclass_passes_is_not_required_of_the_recipe():
    from replicafit.recipes.entries import factory_parameters

    params, open_kwargs = factory_parameters(_PassesBeta)
    assert not open_kwargs and set(params) == {"beta", "width"}
    assert params["beta"].default is not params["beta"].empty  # the recipe need not give it


class _PassesOnly(_Base):
    """Passes everything on: its base's required ``beta`` stays required of the recipe."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)


def test_a_bases_required_argument_the_subclass_does_not_pass_stays_required():
    from replicafit.recipes.entries import factory_parameters

    params, _ = factory_parameters(_PassesOnly)
    assert params["beta"].default is params["beta"].empty
