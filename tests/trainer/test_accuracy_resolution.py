"""``"accuracy"`` and ``"crossentropy"`` resolved from the shapes of labels and predictions (Keras 3's
rule), whatever the loss is: torch loss modules, plain functions, multi-output models, under Mirrored(2)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import make_strategy
from torch import nn

from replicafit import optimizers, recipes
from replicafit.trainer import Trainer, losses, metrics

pytestmark = pytest.mark.timeout(120)

generator = torch.Generator().manual_seed(0)
X = torch.randn(120, 6, generator=generator)
CLASSES = (X[:, 0] > 0).long() + (X[:, 1] > 0.5).long()  # 3 classes
BINARY = (X[:, 2] > 0).float().unsqueeze(1)  # (N, 1) 0/1 labels


def sparse_cross_entropy(y, p):  # a user's plain function (labels first, as every loss here)
    return F.cross_entropy(p, y, reduction="none")


def one_hot_cross_entropy(y, p):
    return -(y * F.log_softmax(p, dim=-1)).sum(-1)


CASES = {
    # name: (the loss under test, the equivalent built-in loss, labels, outputs, expected accuracy class)
    "nn_cross_entropy": (nn.CrossEntropyLoss(), "cross_entropy", CLASSES, 3, metrics.SparseCategoricalAccuracy),
    "nn_bce_with_logits": (
        nn.BCEWithLogitsLoss(),
        losses.BinaryCrossentropy(from_logits=True),
        BINARY,
        1,
        metrics.BinaryAccuracy,
    ),
    "plain_function": (sparse_cross_entropy, "cross_entropy", CLASSES, 3, metrics.SparseCategoricalAccuracy),
    "plain_function_one_hot": (
        one_hot_cross_entropy,
        "categorical_crossentropy",
        F.one_hot(CLASSES, 3).float(),
        3,
        metrics.CategoricalAccuracy,
    ),
}


def fit(loss, labels, outputs, strategy="mirrored2", metric_names=("accuracy",), epochs=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.0), nn.Linear(16, outputs))
    optimizer = optimizers.Adam(0.03)
    trainer = Trainer(
        strategy=make_strategy(strategy), optimizer=optimizer, loss=loss, metrics=list(metric_names), seed=0
    )
    history = trainer.fit(model, (X, labels), batch_size=16, epochs=epochs, validation_split=0.25, verbose=0)
    return trainer, history.history


@pytest.mark.parametrize("case", list(CASES))
def test_accuracy_of_any_loss_equals_the_built_in_losses(case):
    loss, builtin, labels, outputs, cls = CASES[case]
    trainer, history = fit(loss, labels, outputs)
    assert [type(m) for m in trainer._compile_metrics.metrics] == [cls]
    _, expected = fit(builtin, labels, outputs)
    assert history["accuracy"] == expected["accuracy"]
    assert history["val_accuracy"] == expected["val_accuracy"]
    torch.testing.assert_close(torch.tensor(history["loss"]), torch.tensor(expected["loss"]))
    assert history["val_accuracy"][-1] > 0.5  # a real accuracy (an exact match of scores and labels gives 0)


def test_binary_accuracy_of_logits_thresholds_at_zero():
    trainer, history = fit(nn.BCEWithLogitsLoss(), BINARY, 1, strategy="default")
    (metric,) = trainer._compile_metrics.metrics
    assert metric.threshold == 0.0
    probabilities, _ = fit("binary_crossentropy", BINARY, 1, strategy="default")  # a model without sigmoid
    assert probabilities._compile_metrics.metrics[0].threshold == 0.5  # Keras' threshold for probabilities


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(6, 16)
        self.classes, self.flag, self.tags = nn.Linear(16, 3), nn.Linear(16, 1), nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"classes": self.classes(h), "flag": self.flag(h), "tags": self.tags(h)}


TAGS = (X[:, 2:6] > 0).float()  # 4 independent 0/1 labels: same shape as the predictions


def fit_two_heads(loss):
    torch.manual_seed(0)
    trainer = Trainer(strategy=make_strategy("mirrored2"), loss=loss, metrics=["accuracy", "crossentropy"], seed=0)
    labels = {"classes": CLASSES, "flag": BINARY, "tags": TAGS}
    history = trainer.fit(TwoHeads(), (X, labels), batch_size=16, epochs=2, verbose=0)
    return trainer, history.history


def test_multi_output_models_resolve_each_output():
    torch_losses = {"classes": nn.CrossEntropyLoss(), "flag": nn.BCEWithLogitsLoss(), "tags": nn.BCEWithLogitsLoss()}
    trainer, history = fit_two_heads(torch_losses)
    kinds = {m.name: (type(m), getattr(m, "threshold", None)) for m in trainer._compile_metrics.metrics}
    assert kinds["classes_accuracy"] == (metrics.SparseCategoricalAccuracy, None)
    assert kinds["flag_accuracy"] == (metrics.BinaryAccuracy, 0.0)
    assert kinds["tags_accuracy"] == (metrics.BinaryAccuracy, 0.0)  # multi-label: the loss tells
    assert kinds["classes_crossentropy"][0] is metrics.SparseCategoricalCrossentropy
    assert kinds["flag_crossentropy"][0] is metrics.BinaryCrossentropy
    ours = {
        "classes": "cross_entropy",
        "flag": losses.BinaryCrossentropy(from_logits=True),
        "tags": losses.BinaryCrossentropy(from_logits=True),
    }
    _, expected = fit_two_heads(ours)
    for name in ("classes_accuracy", "flag_accuracy", "tags_accuracy"):
        assert history[name] == expected[name], name
    # crossentropy as a metric is the loss of the same name, averaged over the examples
    torch.testing.assert_close(torch.tensor(history["classes_crossentropy"]), torch.tensor(history["classes_loss"]))


@pytest.mark.parametrize(
    "y_shape, p_shape, loss, expected",
    [
        ((8,), (8, 10), None, metrics.SparseCategoricalAccuracy),
        ((8, 1), (8, 10), None, metrics.SparseCategoricalAccuracy),
        ((8, 10), (8, 10), None, metrics.CategoricalAccuracy),
        ((8, 10), (8, 10), nn.BCEWithLogitsLoss(), metrics.BinaryAccuracy),
        ((8,), (8, 1), None, metrics.BinaryAccuracy),
        ((8,), (8,), None, metrics.BinaryAccuracy),
        ((8, 5), (8, 5, 7), nn.CrossEntropyLoss(), metrics.SparseCategoricalAccuracy),  # per-token labels
        ((8, 10), (8, 10), "binary_crossentropy", metrics.BinaryAccuracy),
    ],
)
def test_the_shape_rule(y_shape, p_shape, loss, expected):
    loss = losses.get(loss) if loss is not None else losses.get(functools.partial(sparse_cross_entropy))
    metric = metrics.get("acc", loss, y_true=torch.zeros(y_shape), y_pred=torch.zeros(p_shape))
    assert type(metric) is expected and metric.name == "accuracy"


def test_without_shapes_the_loss_decides():
    assert type(metrics.get("accuracy", losses.get(nn.CrossEntropyLoss()))) is metrics.SparseCategoricalAccuracy
    assert type(metrics.get("accuracy", losses.get(F.binary_cross_entropy_with_logits))) is metrics.BinaryAccuracy
    assert type(metrics.get("accuracy", losses.get(lambda y, p: (p - y) ** 2))) is metrics.Accuracy


def test_crossentropy_in_a_recipe():
    recipe = recipes.load("digits_mlp", overrides=["metrics=[accuracy, ce]", "fit.epochs=1", "fit.verbose=0"])
    run = recipes.build(recipe)
    history = run.trainer.fit(run.model, run.train, callbacks=run.callbacks, **run.fit_kwargs)
    assert set(history.history) >= {"accuracy", "crossentropy", "val_crossentropy"}
    torch.testing.assert_close(
        torch.tensor(history.history["val_crossentropy"]), torch.tensor(history.history["val_loss"])
    )
