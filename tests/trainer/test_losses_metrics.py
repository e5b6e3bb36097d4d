"""Losses (per-example values, names, callables, torch modules, multi-output models) and
metrics (Keras-style streaming, string names, SyncOnRead accumulation under every strategy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import make_strategy
from torch import nn

from replicafit import optimizers
from replicafit.data import as_global_batches
from replicafit.trainer import Trainer, losses, metrics

ALL_STRATEGIES = ["default", "one_device", "mirrored2", "mirrored3", "central_storage2"]
RNG = np.random.default_rng(0)


def t(array) -> torch.Tensor:
    return torch.as_tensor(np.asarray(array))


def close(actual, expected, atol=1e-6, msg=""):
    actual, expected = (v.detach() if isinstance(v, torch.Tensor) else v for v in (actual, expected))
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64), atol=atol, rtol=0, err_msg=msg
    )


# --- losses: every name against torch / NumPy per-example values ------------------------------------------
LOGITS = RNG.standard_normal((6, 4)).astype(np.float32)
LABELS = np.array([0, 3, 1, 2, 3, 0])
ONE_HOT = np.eye(4, dtype=np.float32)[LABELS]
PROBS = RNG.uniform(0.05, 0.95, (6, 3)).astype(np.float32)
BITS = RNG.integers(0, 2, (6, 3)).astype(np.float32)
PRED = RNG.standard_normal((6, 3)).astype(np.float32) * 2
TARGET = RNG.standard_normal((6, 3)).astype(np.float32) * 2


def np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_huber(d, delta=1.0):
    a = np.abs(d)
    return np.where(a <= delta, 0.5 * d**2, delta * (a - 0.5 * delta))


@pytest.mark.parametrize("name", ["cross_entropy", "sparse_categorical_crossentropy"])
def test_sparse_cross_entropy_names(name):
    loss = losses.get(name)
    expected = -np_log_softmax(LOGITS)[np.arange(6), LABELS]
    values = loss(t(LABELS), t(LOGITS))
    assert values.shape == (6,)
    close(values, expected)
    close(values, F.cross_entropy(t(LOGITS), t(LABELS), reduction="none"))
    close(loss(t(LABELS[:, None]), t(LOGITS)), expected)  # (batch, 1) labels, as Keras allows
    # a sequence (batch, time, classes): each example's mean over time
    logits = RNG.standard_normal((3, 5, 4)).astype(np.float32)
    labels = RNG.integers(0, 4, (3, 5))
    per_step = -np.take_along_axis(np_log_softmax(logits), labels[..., None], -1)[..., 0]
    close(loss(t(labels), t(logits)), per_step.mean(-1))


def test_categorical_crossentropy():
    values = losses.get("categorical_crossentropy")(t(ONE_HOT), t(LOGITS))
    assert values.shape == (6,)
    close(values, -(ONE_HOT * np_log_softmax(LOGITS)).sum(-1))
    soft = np.full((6, 4), 0.25, dtype=np.float32)
    close(losses.get("categorical_crossentropy")(t(soft), t(LOGITS)), -(soft * np_log_softmax(LOGITS)).sum(-1))


def test_binary_crossentropy_on_probabilities_and_logits():
    expected = -(BITS * np.log(PROBS) + (1 - BITS) * np.log(1 - PROBS)).mean(-1)
    values = losses.get("binary_crossentropy")(t(BITS), t(PROBS))
    assert values.shape == (6,)
    close(values, expected, atol=1e-5)
    close(values, F.binary_cross_entropy(t(PROBS), t(BITS), reduction="none").mean(-1))
    # one probability per example, labels of shape (batch,)
    single = losses.get("binary_crossentropy")(t(BITS[:, 0]), t(PROBS[:, :1]))
    assert single.shape == (6,)
    close(single, -(BITS[:, 0] * np.log(PROBS[:, 0]) + (1 - BITS[:, 0]) * np.log(1 - PROBS[:, 0])), atol=1e-5)
    logits = PRED
    from_logits = losses.BinaryCrossentropy(from_logits=True)(t(BITS), t(logits))
    close(from_logits, F.binary_cross_entropy_with_logits(t(logits), t(BITS), reduction="none").mean(-1))
    probs = 1 / (1 + np.exp(-logits.astype(np.float64)))
    close(from_logits, -(BITS * np.log(probs) + (1 - BITS) * np.log(1 - probs)).mean(-1), atol=1e-5)


@pytest.mark.parametrize(
    "name, reference",
    [
        ("mse", lambda d: (d**2).mean(-1)),
        ("mean_squared_error", lambda d: (d**2).mean(-1)),
        ("mae", lambda d: np.abs(d).mean(-1)),
        ("mean_absolute_error", lambda d: np.abs(d).mean(-1)),
        ("huber", lambda d: np_huber(d).mean(-1)),
    ],
)
def test_regression_losses(name, reference):
    loss = losses.get(name)
    values = loss(t(TARGET), t(PRED))
    assert values.shape == (6,)
    close(values, reference(PRED - TARGET), atol=1e-5)
    # targets of shape (batch,) against predictions of shape (batch, 1)
    close(loss(t(TARGET[:, 0]), t(PRED[:, :1])), reference(PRED[:, :1] - TARGET[:, :1]), atol=1e-5)


def test_huber_matches_torch_and_uses_delta():
    close(losses.get("huber")(t(TARGET), t(PRED)), F.huber_loss(t(PRED), t(TARGET), reduction="none").mean(-1))
    close(losses.Huber(delta=2.0)(t(TARGET), t(PRED)), np_huber(PRED - TARGET, 2.0).mean(-1), atol=1e-5)


def test_a_callable_loss():
    def squared_sum(y_true, y_pred):
        return ((y_pred - y_true) ** 2).sum(-1)

    loss = losses.get(squared_sum)
    close(loss(t(TARGET), t(PRED)), ((PRED - TARGET) ** 2).sum(-1), atol=1e-5)
    assert "squared_sum" in repr(loss) or loss.name == "squared_sum"


def test_a_torch_loss_module_is_used_with_reduction_none():
    module = nn.SmoothL1Loss()
    loss = losses.get(module)
    values = loss(t(TARGET), t(PRED))
    assert values.shape == (6,)
    close(values, F.smooth_l1_loss(t(PRED), t(TARGET), reduction="none").mean(-1))
    assert module.reduction == "mean"  # the user's module is not changed
    # called as torch calls it: module(prediction, target)
    close(losses.get(nn.CrossEntropyLoss())(t(LABELS), t(LOGITS)), -np_log_softmax(LOGITS)[np.arange(6), LABELS])


def test_a_loss_returning_a_scalar_is_a_clear_value_error():
    loss = losses.get(lambda y_true, y_pred: ((y_pred - y_true) ** 2).mean())
    with pytest.raises(ValueError, match="(?i)scalar.*per example|per example.*scalar"):
        loss(t(TARGET), t(PRED))
    x, y = RNG.standard_normal((10, 3)).astype(np.float32), RNG.standard_normal((10, 1)).astype(np.float32)
    trainer = Trainer(loss=lambda y_true, y_pred: ((y_pred - y_true) ** 2).mean(), metrics=(), seed=0)
    with pytest.raises(ValueError, match="(?i)scalar"):
        trainer.fit(nn.Linear(3, 1), (x, y), batch_size=4, verbose=0)


def test_an_unknown_loss_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"did you mean 'cross_entropy'"):
        losses.get("cross_entropyy")
    with pytest.raises(ValueError, match=r"did you mean 'huber'"):
        Trainer(loss="hubber")
    with pytest.raises(ValueError, match="Unknown loss"):
        losses.get("zzzzzz")


# --- losses through the trainer: the step loss and multi-output models ------------------------------------------
class TwoHeads(nn.Module):
    def __init__(self, as_tuple: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 1)
        self.as_tuple = as_tuple

    def forward(self, x):
        a, b = self.a(x), self.b(x)
        return (a, b) if self.as_tuple else {"a": a, "b": b}


def two_head_data(n=10):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    return x, rng.standard_normal((n, 2)).astype(np.float32), rng.standard_normal((n, 1)).astype(np.float32)


def head_outputs(model, x):
    with torch.no_grad():
        return model.a(t(x)).numpy(), model.b(t(x)).numpy()


@pytest.mark.parametrize("strategy_name", ["default", "mirrored3"])
@pytest.mark.parametrize("form", ["dict_one_loss", "dict_of_losses", "tuple_one_loss", "tuple_list_of_losses"])
def test_multi_output_losses_are_summed_and_logged_per_output(strategy_name, form):
    x, ya, yb = two_head_data()
    as_tuple = form.startswith("tuple")
    model = TwoHeads(as_tuple)
    loss = {
        "dict_one_loss": "mse",
        "dict_of_losses": {"a": "mse", "b": "mae"},
        "tuple_one_loss": "mse",
        "tuple_list_of_losses": ["mse", "mae"],
    }[form]
    names = ["output_0", "output_1"] if as_tuple else ["a", "b"]
    y = (ya, yb) if as_tuple else {"a": ya, "b": yb}
    trainer = Trainer(strategy=make_strategy(strategy_name), optimizer=optimizers.SGD(0.05), loss=loss, metrics=())
    logs = trainer.evaluate(model, (x, y), batch_size=4, return_dict=True, verbose=0)
    assert set(logs) == {"loss", f"{names[0]}_loss", f"{names[1]}_loss"}
    pa, pb = head_outputs(model, x)
    expected_a = ((pa - ya) ** 2).mean()
    expected_b = ((pb - yb) ** 2).mean() if form.endswith("one_loss") else np.abs(pb - yb).mean()
    close(logs[f"{names[0]}_loss"], expected_a, atol=1e-5)
    close(logs[f"{names[1]}_loss"], expected_b, atol=1e-5)
    close(logs["loss"], expected_a + expected_b, atol=1e-5)

    history = trainer.fit(model, (x, y), batch_size=4, epochs=2, verbose=0)
    assert set(history.history) == {"loss", f"{names[0]}_loss", f"{names[1]}_loss"}
    for epoch in range(2):
        total = history.history[f"{names[0]}_loss"][epoch] + history.history[f"{names[1]}_loss"][epoch]
        close(history.history["loss"][epoch], total, atol=1e-5)
    assert history.history["loss"][1] < history.history["loss"][0]


def test_multi_output_metrics_are_named_per_output():
    x, ya, yb = two_head_data()
    trainer = Trainer(loss="mse", metrics=["mae"])
    logs = trainer.evaluate(TwoHeads(), (x, {"a": ya, "b": yb}), batch_size=4, return_dict=True, verbose=0)
    assert set(logs) == {"loss", "a_loss", "b_loss", "a_mae", "b_mae"}
    pa, pb = head_outputs(TwoHeads(), x)
    close(logs["a_mae"], np.abs(pa - ya).mean(), atol=1e-5)
    close(logs["b_mae"], np.abs(pb - yb).mean(), atol=1e-5)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_each_loss_name_drives_training_to_the_torch_update(strategy_name):
    """One SGD step on a partial batch: the gradient of sum(per-example loss) / global batch."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((5, 3)).astype(np.float32)
    cases = {
        "cross_entropy": (rng.integers(0, 3, 5), lambda p, y: F.cross_entropy(p, y, reduction="none")),
        "categorical_crossentropy": (
            np.eye(3, dtype=np.float32)[rng.integers(0, 3, 5)],
            lambda p, y: -(y * F.log_softmax(p, -1)).sum(-1),
        ),
        "mse": (rng.standard_normal((5, 3)).astype(np.float32), lambda p, y: ((p - y) ** 2).mean(-1)),
        "huber": (
            rng.standard_normal((5, 3)).astype(np.float32),
            lambda p, y: F.huber_loss(p, y, reduction="none").mean(-1),
        ),
    }
    for name, (y, reference_loss) in cases.items():
        torch.manual_seed(0)
        reference = nn.Linear(3, 3)
        torch.manual_seed(0)
        model = nn.Linear(3, 3)
        (reference_loss(reference(t(x)), t(y)).sum() / 5).backward()
        trainer = Trainer(strategy=make_strategy(strategy_name), optimizer=optimizers.SGD(0.5), loss=name, metrics=())
        trainer.fit(model, (x, y), batch_size=5, verbose=0)
        for (key, p), q in zip(reference.named_parameters(), model.parameters()):
            close(q, p - 0.5 * p.grad, atol=1e-6, msg=f"{name} {key}")


# --- metrics: Keras-style streaming -------------------------------------------------------------------------------
def test_mean_and_sum_stream_like_keras():
    mean = metrics.Mean()
    assert float(mean.result()) == 0.0
    mean.update_state(t([1.0, 2.0, 3.0]))
    mean.update_state(t([4.0]), sample_weight=t([3.0]))
    close(mean.result(), (1 + 2 + 3 + 12) / 6)
    mean.reset_state()
    assert float(mean.result()) == 0.0
    mean.update_state(5.0)
    close(mean.result(), 5.0)

    total = metrics.Sum()
    total.update_state(t([1.0, 2.0]))
    total.update_state(t([3.0, 4.0]), sample_weight=t([0.5, 2.0]))
    close(total.result(), 1 + 2 + 1.5 + 8)
    total.reset_state()
    assert float(total.result()) == 0.0


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_a_metrics_state_variables_are_its_accumulators_by_name(strategy_name):
    strategy = make_strategy(strategy_name)
    mean = metrics.Mean()
    assert mean.state_variables() == {} and mean.variables == []
    mean.build(strategy)
    states = mean.state_variables()
    assert list(states) == list(mean.state_dict()) == ["total", "count"]
    assert [id(v) for v in states.values()] == [id(v) for v in mean.variables]
    states.clear()  # a copy: the metric keeps its own
    assert list(mean.state_variables()) == ["total", "count"]
    assert len(strategy.experimental_local_results(mean.state_variables()["total"])) == strategy.num_replicas_in_sync


SCORES = RNG.standard_normal((9, 5)).astype(np.float32)
CLASSES = np.array([0, 1, 2, 3, 4, 4, 3, 2, 1])
CLASSES[:4] = SCORES[:4].argmax(-1)  # some hits for sure
WEIGHTS = np.array([1, 0, 2, 1, 1, 3, 0.5, 1, 1], dtype=np.float32)


def weighted_mean(values, weights=None):
    values = np.asarray(values, dtype=np.float64)
    if weights is None:
        return values.mean()
    return (values * weights).sum() / weights.sum()


def top_k_hits(scores, labels, k):
    return np.array([label in np.argsort(-row)[:k] for row, label in zip(scores, labels)], dtype=np.float64)


BIN_PROBS = RNG.uniform(0, 1, (9, 2)).astype(np.float32)
BIN_LABELS = RNG.integers(0, 2, (9, 2)).astype(np.float32)
EXACT_PRED = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
EXACT_TRUE = np.array([1, 2, 0, 4, 0, 6, 7, 0, 9])

# name -> (factory, y_true, y_pred, per-example NumPy values)
METRIC_CASES = {
    "accuracy": (metrics.Accuracy, EXACT_TRUE, EXACT_PRED, (EXACT_TRUE == EXACT_PRED).astype(float)),
    "sparse_categorical_accuracy": (
        metrics.SparseCategoricalAccuracy,
        CLASSES,
        SCORES,
        (SCORES.argmax(-1) == CLASSES).astype(float),
    ),
    "categorical_accuracy": (
        metrics.CategoricalAccuracy,
        np.eye(5, dtype=np.float32)[CLASSES],
        SCORES,
        (SCORES.argmax(-1) == CLASSES).astype(float),
    ),
    "binary_accuracy": (
        metrics.BinaryAccuracy,
        BIN_LABELS,
        BIN_PROBS,
        ((BIN_PROBS > 0.5) == BIN_LABELS).mean(-1),
    ),
    "top_k_categorical_accuracy": (
        lambda: metrics.TopKCategoricalAccuracy(k=2),
        np.eye(5, dtype=np.float32)[CLASSES],
        SCORES,
        top_k_hits(SCORES, CLASSES, 2),
    ),
    "mean_squared_error": (metrics.MeanSquaredError, TARGET[:6], PRED[:6], ((PRED[:6] - TARGET[:6]) ** 2).mean(-1)),
    "mean_absolute_error": (metrics.MeanAbsoluteError, TARGET[:6], PRED[:6], np.abs(PRED[:6] - TARGET[:6]).mean(-1)),
}


@pytest.mark.parametrize("name", list(METRIC_CASES))
def test_metric_values_against_numpy(name):
    factory, y_true, y_pred, per_example = METRIC_CASES[name]
    metric = factory()
    metric.update_state(t(y_true[:4]), t(y_pred[:4]))
    metric.update_state(t(y_true[4:]), t(y_pred[4:]))
    close(metric.result(), weighted_mean(per_example))
    metric.reset_state()
    assert float(metric.result()) == 0.0
    n = len(y_true)
    weights = WEIGHTS[:n]
    metric.update_state(t(y_true), t(y_pred), sample_weight=t(weights))
    close(metric.result(), weighted_mean(per_example, weights))


def test_binary_accuracy_threshold_and_top_k_with_integer_labels():
    metric = metrics.BinaryAccuracy(threshold=0.0)
    logits = PRED[:, :2]
    metric.update_state(t(BIN_LABELS[:6]), t(logits))
    close(metric.result(), ((logits > 0) == BIN_LABELS[:6]).mean())
    top = metrics.TopKCategoricalAccuracy(k=3)
    top.update_state(t(CLASSES), t(SCORES))
    close(top.result(), top_k_hits(SCORES, CLASSES, 3).mean())


# --- AUC -------------------------------------------------------------------------------------------------------
def keras_thresholds(n):
    return np.array([-1e-7] + [(i + 1) / (n - 1) for i in range(n - 2)] + [1 + 1e-7])


def numpy_roc_auc(labels, scores, num_thresholds, weights=None):
    weights = np.ones_like(scores) if weights is None else weights
    thresholds = keras_thresholds(num_thresholds)
    above = scores[None, :] > thresholds[:, None]
    tp = (above * (labels * weights)).sum(1)
    fp = (above * ((1 - labels) * weights)).sum(1)
    tpr = tp / (labels * weights).sum()
    fpr = fp / ((1 - labels) * weights).sum()
    # thresholds ascend, so (fpr, tpr) run from (1, 1) to (0, 0): integrate the reversed curve
    return np.trapezoid(tpr[::-1], fpr[::-1]) if hasattr(np, "trapezoid") else np.trapz(tpr[::-1], fpr[::-1])


def exact_auc(labels, scores):
    """The probability that a random positive outscores a random negative (ties count one half)."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    return ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size


def test_auc_matches_a_numpy_trapezoid_roc_on_the_same_thresholds():
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 2, 200).astype(np.float32)
    scores = np.clip(0.3 * labels + rng.uniform(0, 0.7, 200), 0, 1).astype(np.float32)
    for num_thresholds in (7, 50, 200):
        auc = metrics.AUC(num_thresholds=num_thresholds)
        auc.update_state(t(labels[:120]), t(scores[:120]))
        auc.update_state(t(labels[120:]), t(scores[120:]))
        close(auc.result(), numpy_roc_auc(labels, scores, num_thresholds), atol=1e-5)
    weights = rng.uniform(0, 2, 200).astype(np.float32)
    auc = metrics.AUC(num_thresholds=50)
    auc.update_state(t(labels), t(scores), sample_weight=t(weights))
    close(auc.result(), numpy_roc_auc(labels, scores, 50, weights), atol=1e-5)
    auc.reset_state()
    auc.update_state(t(labels), t(scores))
    close(auc.result(), numpy_roc_auc(labels, scores, 50), atol=1e-5)


def test_auc_is_close_to_the_exact_auc_for_well_separated_scores():
    rng = np.random.default_rng(12)
    labels = (np.arange(400) % 2).astype(np.float32)
    scores = np.where(labels == 1, rng.uniform(0.35, 1.0, 400), rng.uniform(0.0, 0.65, 400)).astype(np.float32)
    exact = exact_auc(labels, scores)
    assert 0.8 < exact < 0.99
    auc = metrics.AUC()
    auc.update_state(t(labels), t(scores))
    assert abs(float(auc.result()) - exact) < 1e-2
    # perfectly separated scores give 1, reversed ones 0
    perfect = metrics.AUC()
    perfect.update_state(t(labels), t(np.where(labels == 1, 0.9, 0.1).astype(np.float32)))
    close(perfect.result(), 1.0, atol=1e-6)
    reversed_ = metrics.AUC()
    reversed_.update_state(t(labels), t(np.where(labels == 1, 0.1, 0.9).astype(np.float32)))
    close(reversed_.result(), 0.0, atol=1e-6)
    # from_logits applies a sigmoid first
    logits = np.log(scores / (1 - scores)).astype(np.float32)
    from_logits = metrics.AUC(from_logits=True)
    from_logits.update_state(t(labels), t(logits))
    close(from_logits.result(), float(auc.result()), atol=1e-4)


# --- names ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, cls",
    [
        ("mean", metrics.Mean),
        ("sum", metrics.Sum),
        ("sparse_categorical_accuracy", metrics.SparseCategoricalAccuracy),
        ("categorical_accuracy", metrics.CategoricalAccuracy),
        ("binary_accuracy", metrics.BinaryAccuracy),
        ("top_k_categorical_accuracy", metrics.TopKCategoricalAccuracy),
        ("mse", metrics.MeanSquaredError),
        ("mae", metrics.MeanAbsoluteError),
        ("auc", metrics.AUC),
    ],
)
def test_metric_names(name, cls):
    metric = metrics.get(name)
    assert type(metric) is cls
    assert metric.name == name


@pytest.mark.parametrize(
    "loss, cls",
    [
        ("cross_entropy", metrics.SparseCategoricalAccuracy),
        ("sparse_categorical_crossentropy", metrics.SparseCategoricalAccuracy),
        ("categorical_crossentropy", metrics.CategoricalAccuracy),
        ("binary_crossentropy", metrics.BinaryAccuracy),
        ("mse", metrics.Accuracy),
    ],
)
def test_accuracy_follows_the_loss(loss, cls):
    for alias in ("accuracy", "acc"):
        metric = metrics.get(alias, losses.get(loss))
        assert type(metric) is cls
        assert metric.name == "accuracy"


def test_an_unknown_metric_name_suggests_the_closest():
    with pytest.raises(ValueError, match=r"did you mean 'accuracy'"):
        metrics.get("acuracy")
    with pytest.raises(ValueError, match=r"did you mean 'auc'"):
        Trainer(metrics=["aucc"]).evaluate(nn.Linear(3, 2), (np.zeros((4, 3), np.float32), np.zeros(4)), verbose=0)


def test_accuracy_through_the_trainer_follows_a_binary_loss():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((10, 3)).astype(np.float32)
    y = rng.integers(0, 2, (10, 1)).astype(np.float32)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Sigmoid())
    trainer = Trainer(strategy=make_strategy("mirrored2"), loss="binary_crossentropy", metrics=["accuracy", "auc"])
    logs = trainer.evaluate(model, (x, y), batch_size=4, return_dict=True, verbose=0)
    with torch.no_grad():
        p = model(t(x)).numpy()
    close(logs["accuracy"], ((p > 0.5) == y).mean())
    close(logs["loss"], -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean(), atol=1e-5)
    close(logs["auc"], numpy_roc_auc(y[:, 0], p[:, 0], 200), atol=1e-5)


# --- metrics inside strategy.run: global values under every strategy ---------------------------------------------
def distributed_result(strategy, metric, y_true, y_pred, weights=None, batch_size=6):
    metric.build(strategy)
    data = (y_true, y_pred) if weights is None else (y_true, y_pred, weights)
    batches = as_global_batches(tuple(t(a) for a in data), batch_size=batch_size)

    def step(*parts):
        metric.update_state(*parts[:2], sample_weight=parts[2] if len(parts) == 3 else None)

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=tuple(batch))
    with strategy.scope():
        return float(metric.result())


AUC_LABELS = (np.arange(9) % 2).astype(np.float32)
AUC_SCORES = RNG.uniform(0, 1, 9).astype(np.float32)


def check_every_metric(strategy, batch_size):
    for name, (factory, y_true, y_pred, per_example) in METRIC_CASES.items():
        value = distributed_result(strategy, factory(), y_true, y_pred, batch_size=batch_size)
        close(value, weighted_mean(per_example), atol=1e-6, msg=name)
        n = len(y_true)
        value = distributed_result(strategy, factory(), y_true, y_pred, WEIGHTS[:n], batch_size=batch_size)
        close(value, weighted_mean(per_example, WEIGHTS[:n]), atol=1e-6, msg=name)
    value = distributed_result(strategy, metrics.AUC(num_thresholds=20), AUC_LABELS, AUC_SCORES, batch_size=batch_size)
    close(value, numpy_roc_auc(AUC_LABELS, AUC_SCORES, 20), atol=1e-6)

    values, weights = np.arange(9, dtype=np.float32), WEIGHTS
    mean, weighted, total = metrics.Mean(), metrics.Mean(), metrics.Sum()
    for metric in (mean, weighted, total):
        metric.build(strategy)

    def step(v, w):
        mean.update_state(v)
        weighted.update_state(v, sample_weight=w)
        total.update_state(v, sample_weight=w)

    batches = as_global_batches((t(values), t(weights)), batch_size=batch_size)
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=tuple(batch))
    with strategy.scope():
        close(mean.result(), 4.0)
        close(weighted.result(), weighted_mean(values, weights))
        close(total.result(), (values * weights).sum(), atol=1e-5)
        # reset_state zeroes every replica's accumulator
        total.reset_state()
        assert float(total.result()) == 0.0


@pytest.mark.parametrize("strategy_name", ALL_STRATEGIES)
def test_metrics_accumulated_inside_strategy_run_are_global(strategy_name):
    """Batches of 6 over 6 or 9 rows: uneven but never empty replica slices."""
    check_every_metric(make_strategy(strategy_name), batch_size=6)


@pytest.mark.parametrize("strategy_name", ["mirrored2", "mirrored3", "central_storage2"])
def test_metrics_accept_empty_replica_slices(strategy_name):
    """Batches of 4: the partial last batch leaves a replica an empty slice (Mirrored(3): every batch),
    which must count for nothing, as the trainer promises for partial and empty replica batches."""
    check_every_metric(make_strategy(strategy_name), batch_size=4)


@pytest.mark.parametrize(
    "module",
    [nn.CrossEntropyLoss(weight=torch.linspace(0.5, 1.5, 3)), nn.BCEWithLogitsLoss(pos_weight=torch.full((3,), 2.0))],
)
def test_a_torch_loss_modules_weights_go_where_the_predictions_are(module):
    """A class weight (or ``pos_weight``) given on the host meets predictions on an accelerator (here torch's
    ``meta`` device, which a host tensor meets with an error as a GPU's would): the loss uses a copy of the
    module on the predictions' device, and the user's module keeps its weight where it was."""
    loss = losses.get(module)
    logits = torch.zeros(4, 3, device="meta")
    labels = torch.zeros(4, dtype=torch.long, device="meta")
    if isinstance(module, nn.BCEWithLogitsLoss):
        labels = torch.zeros(4, 3, device="meta")
    values = loss(labels, logits)
    assert values.device.type == "meta"
    assert all(t.device.type == "cpu" for t in module.buffers())


def test_a_torch_loss_modules_copy_on_another_device_follows_the_users_weight():
    """The copy on the predictions' device follows the user's weight when it changes (a class weight adjusted
    between epochs: written in place, or a new tensor), is made outside inference mode whatever mode the first call
    ran in (an evaluate under ``torch.inference_mode`` before a fit), and is not pickled; torch's ``meta`` device
    stands for an accelerator."""
    import pickle

    user = nn.CrossEntropyLoss(weight=torch.ones(3))
    loss = losses.get(user)
    logits, labels = torch.zeros(4, 3, device="meta"), torch.zeros(4, dtype=torch.long, device="meta")
    with torch.inference_mode():
        loss(labels, logits)
    first = loss._module_on(logits.device)
    assert not first.weight.is_inference()  # (usable in a backward pass later)
    assert loss._module_on(logits.device) is first  # (made once while the weight stays as it is)
    user.weight.mul_(2.0)
    second = loss._module_on(logits.device)
    assert second is not first
    for _ in range(20):  # a new tensor each time, though the freed one's id may come back
        user.weight = torch.ones(3)
        third = loss._module_on(logits.device)
        assert third is not second
        second = third
    assert "_copies" not in pickle.loads(pickle.dumps(loss)).__dict__


def test_a_loss_module_with_parameters_on_another_device_is_refused():
    """A loss that learns (parameters) on the host while the predictions are on an accelerator: said, with the fix,
    rather than training a copy the user never sees."""

    class Learned(nn.CrossEntropyLoss):  # a torch loss module, called as torch calls it
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, y_pred, y_true):
            return self.scale * super().forward(y_pred, y_true)

    loss = losses.get(Learned())
    with pytest.raises(
        ValueError,
        match=r"has parameters, and its tensors are on cpu while the predictions are on meta.*\.to\('meta'\)",
    ):
        loss(torch.zeros(4, dtype=torch.long, device="meta"), torch.zeros(4, 3, device="meta"))
