"""``fit``/``evaluate``/``predict`` check their plain arguments at the entry and say what to do (issue 16,
part 2): an error names the argument, what arrived and the fix, before any replica runs."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import make_strategy

from replicafit import optimizers
from replicafit.trainer import Trainer

pytestmark = pytest.mark.timeout(60)

X = np.random.default_rng(0).standard_normal((32, 4)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 2, 32)


def no_replica_frames(info) -> bool:
    return not any("strategies" in str(entry.path) for entry in info.traceback)


@pytest.mark.parametrize(
    "call",
    [
        lambda t, m: t.fit(m, X, Y, batch_size=8, verbose=0),
        lambda t, m: t.evaluate(m, X, Y, verbose=0),
        lambda t, m: t.predict(m, X, torch.tensor(Y)),
    ],
    ids=["fit", "evaluate", "predict"],
)
def test_keras_x_y_habit_says_pass_a_tuple(call):
    with pytest.raises(
        TypeError, match=r"got an array for `\w+`.*Pass the data as one argument: \w+\(model, \(x, y\)"
    ) as info:
        call(Trainer(strategy=None), torch.nn.Linear(4, 2))
    assert no_replica_frames(info)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"epochs": "5"}, TypeError, r"`epochs` must be an int >= 0, got '5' \(str\)"),
        ({"epochs": 2.0}, TypeError, r"`epochs` must be an int >= 0, got 2.0 \(float\)"),
        ({"epochs": -1}, ValueError, r"`epochs` must be an int >= 0"),
        ({"validation_split": "0.2"}, TypeError, r"`validation_split` must be a number in \[0, 1\) \(e.g. 0.2\)"),
        ({"steps_per_epoch": 0}, ValueError, r"`steps_per_epoch` must be None or an int >= 1"),
        ({"initial_epoch": "1"}, TypeError, r"`initial_epoch` must be an int >= 0"),
        ({"shuffle": "batch"}, TypeError, r"`shuffle` must be True or False"),
    ],
)
def test_fit_arguments_of_the_wrong_type(kwargs, error, message):
    with pytest.raises(error, match=message) as info:
        Trainer().fit(torch.nn.Linear(4, 2), (X, Y), **({"batch_size": 8, "verbose": 0} | kwargs))
    assert no_replica_frames(info)


def test_numpy_integers_are_integers():
    history = Trainer().fit(torch.nn.Linear(4, 2), (X, Y), batch_size=np.int64(8), epochs=np.int32(2), verbose=0)
    assert len(history.history["loss"]) == 2


def test_from_torch_given_an_optimizer_instance_shows_the_right_call():
    instance = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError) as info:
        optimizers.from_torch(instance)
    message = str(info.value)
    assert "optimizers.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)" in message
    assert "\n" not in message and len(message) < 300  # no repr of the instance


@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_float64_inputs_train_as_the_models_float32(strategy):
    x64 = np.random.default_rng(2).standard_normal((40, 4))  # NumPy's default float64
    y64 = x64[:, :1] * 2.0 - 1.0  # float64 regression targets
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(x64), torch.tensor(y64)), 8)

    def run(data, **kwargs):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        trainer = Trainer(strategy=make_strategy(strategy), loss="mse", metrics=["mae"], seed=0)
        history = trainer.fit(model, data, epochs=2, verbose=0, shuffle=False, **kwargs)
        prediction = trainer.predict(model, x64, batch_size=8)
        return history.history, [p.detach().clone() for p in model.parameters()], prediction

    expected = run((x64.astype(np.float32), y64.astype(np.float32)), batch_size=8)
    for got in (run((x64, y64), batch_size=8), run(loader)):
        assert got[0] == expected[0]
        assert all(torch.equal(a, b) for a, b in zip(got[1], expected[1]))
        assert got[2].dtype == torch.float32 and torch.equal(got[2], expected[2])


# --- the first batch meets the loss: checked once, at the entry ---------------------------------------------------

STRUCTURES = r"Batches are understood as x, \(x, y\) or \(x, y, sample_weight\)"


@pytest.mark.parametrize("strategy", ["default", "mirrored2"], indirect=True)
@pytest.mark.parametrize("method", ["fit", "evaluate"])
def test_batches_without_labels_say_which_structures_are_understood(strategy, method):
    trainer = Trainer(strategy=strategy, loss="cross_entropy")
    call = getattr(trainer, method)
    with pytest.raises(
        ValueError,
        match=rf"{method}\(\) got batches without labels: the first batch is a Tensor of "
        rf"shape \[8, 4\].*{STRUCTURES}.*pass {method}\(model, \(x, y\)\)",
    ) as info:
        call(torch.nn.Linear(4, 2), X, batch_size=8, verbose=0)
    assert no_replica_frames(info)


def test_a_dataloader_of_dicts_is_told_where_its_labels_are():
    rows = [{"image": torch.randn(4), "label": int(Y[i])} for i in range(16)]
    loader = torch.utils.data.DataLoader(rows, batch_size=8)
    with pytest.raises(
        ValueError,
        match=r"a dict with keys \['image', 'label'\].*under 'label': yield "
        r"\(inputs, batch\['label'\]\)",
    ) as info:
        Trainer(strategy=make_strategy("mirrored2")).fit(torch.nn.Linear(4, 2), loader, verbose=0)
    assert no_replica_frames(info)


class _DictModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, inputs):
        return self.a(inputs["a"]) + self.b(inputs["b"])


def test_a_dict_of_inputs_with_labels_trains_and_a_model_that_cannot_take_it_is_told_why():
    history = Trainer(loss="cross_entropy").fit(_DictModel(), ({"a": X, "b": X}, Y), batch_size=8, verbose=0)
    assert len(history.history["loss"]) == 1
    with pytest.raises(
        TypeError,
        match=r"The model cannot take the inputs of the first batch of fit\(\): a dict "
        rf"with keys \['a', 'b'\].*{STRUCTURES}",
    ) as info:
        Trainer().fit(torch.nn.Linear(4, 2), ({"a": X, "b": X}, Y), batch_size=8, verbose=0)
    assert no_replica_frames(info)


def test_a_loss_of_ones_own_may_go_without_labels():
    # a callable may ignore y (an autoencoder's or a regulariser's loss): no labels is no error there
    history = Trainer(loss=lambda y, p: p.pow(2).mean(dim=1), optimizer="sgd").fit(
        torch.nn.Linear(4, 2), X, batch_size=8, verbose=0
    )
    assert history.history["loss"][0] > 0


def _torch_order_loss(input, target):
    return torch.nn.functional.cross_entropy(input, target, reduction="none")


@pytest.mark.parametrize("strategy", ["default", "mirrored2"], indirect=True)
def test_a_callable_loss_in_torchs_order_is_detected_on_the_first_batch(strategy):
    with pytest.raises(
        ValueError,
        match=r"The loss _torch_order_loss takes its arguments in torch's order "
        r"\(input, target\).*Pass loss=lambda y_true, y_pred: _torch_order_loss\(y_pred, y_true\)",
    ) as info:
        Trainer(strategy=strategy, loss=_torch_order_loss).fit(torch.nn.Linear(4, 2), (X, Y), batch_size=8, verbose=0)
    assert no_replica_frames(info)


@pytest.mark.parametrize(
    "loss",
    [torch.nn.functional.cross_entropy, torch.nn.CrossEntropyLoss(), "cross_entropy"],
    ids=["F.cross_entropy", "nn.CrossEntropyLoss", "built-in"],
)
def test_torchs_functional_losses_are_called_in_torchs_order(loss):
    def run(loss):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return Trainer(loss=loss, optimizer="sgd", seed=0).fit(model, (X, Y), batch_size=8, epochs=2, verbose=0)

    assert run(loss).history == run("cross_entropy").history


@pytest.mark.parametrize("strategy", ["default", "mirrored2"], indirect=True)
@pytest.mark.parametrize(
    "loss, found",
    [
        ("cross_entropy", r"found the label 2 \(labels from 0 to 2\)"),
        (torch.nn.CrossEntropyLoss(), r"found the label 2"),
        (torch.nn.functional.cross_entropy, r"found the label 2"),
    ],
    ids=["built-in", "nn.CrossEntropyLoss", "F.cross_entropy"],
)
def test_labels_out_of_range_say_the_classes_and_the_label(strategy, loss, found):
    labels = Y.copy()
    labels[3] = 2  # a model of 2 classes
    name = r"\w+"
    with pytest.raises(
        ValueError,
        match=rf"Labels out of range for the loss {name}: the model outputs 2 classes, so "
        rf"labels must be 0..1; {found}",
    ) as info:
        Trainer(strategy=strategy, loss=loss).fit(torch.nn.Linear(4, 2), (X, labels), batch_size=8, verbose=0)
    assert no_replica_frames(info)


def test_one_based_labels_get_the_hint_and_later_batches_are_caught_too():
    with pytest.raises(ValueError, match=r"found the label 2 \(labels from 1 to 2\) \(1-based labels\? subtract 1\)"):
        Trainer().fit(torch.nn.Linear(4, 2), (X, Y + 1), batch_size=8, verbose=0)
    labels = Y.copy()
    labels[-1] = 7  # in the last batch only: arrays are checked whole at the entry
    with pytest.raises(
        ValueError, match=r"the model outputs 2 classes, so labels must be 0..1; found the label 7"
    ) as info:
        Trainer(strategy=make_strategy("mirrored2")).fit(torch.nn.Linear(4, 2), (X, labels), batch_size=8, verbose=0)
    assert no_replica_frames(info)
    # a DataLoader's later batch: the loss says it when it meets it (inside the step)
    loader = torch.utils.data.DataLoader(list(zip(torch.from_numpy(X), torch.from_numpy(labels))), batch_size=8)
    with pytest.raises(ValueError, match=r"the model outputs 2 classes, so labels must be 0..1; found the label 7"):
        Trainer(strategy=make_strategy("mirrored2")).fit(torch.nn.Linear(4, 2), loader, verbose=0)


def test_torchs_ignore_index_is_not_out_of_range():
    labels = Y.copy()
    labels[0] = -100
    history = Trainer(loss=torch.nn.CrossEntropyLoss()).fit(torch.nn.Linear(4, 2), (X, labels), batch_size=8, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_the_first_batch_is_probed_on_the_models_device():
    """A host batch probes a model on another device (an accelerator; here torch's ``meta`` device, which a host
    tensor meets with an error as a GPU's parameters would) with its probe and labels moved there: before, ``fit``
    of host data under a GPU strategy failed at the entry check ("not on the expected device")."""
    trainer = Trainer(loss="cross_entropy", metrics=["accuracy"])
    dm = types.SimpleNamespace(module=torch.nn.Linear(4, 3, device="meta"), gathers_parameters=False)
    found = trainer._input_checks.check_first_batch(
        (X[:5], Y[:5]), dm, "fit()", float_dtype=torch.float32, builtin_step=True
    )
    assert found.outputs.device.type == "meta" and found.labels.device.type == "meta"


def test_the_probe_of_a_models_own_loss_runs_on_the_models_device():
    """``loss=None``: the probe of whether the model's loss counts items gives its inputs on the model's device
    (the model's first parameter on ``meta`` stands for an accelerator; it computes on the host, from the inputs'
    shapes, to be read)."""
    seen = set()

    class OwnLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1, device="meta"))  # the first parameter: its device
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, x, labels=None, num_items_in_batch=None):
            seen.update({x.device.type, *([] if labels is None else [labels.device.type])})
            logits = self.linear(torch.ones(x.shape))  # (a meta tensor holds no values: its shape only)
            if labels is None:
                return logits
            zeros = torch.zeros(labels.shape, dtype=torch.long)
            total = torch.nn.functional.cross_entropy(logits, zeros, reduction="sum")
            return {"loss": total / (num_items_in_batch or len(x)), "logits": logits}

    trainer = Trainer(loss=None, metrics=())
    dm = types.SimpleNamespace(module=OwnLoss(), gathers_parameters=False)
    first = {"x": X[:5], "labels": torch.tensor(Y[:5])}
    found = trainer._input_checks.check_first_batch(first, dm, "fit()", float_dtype=torch.float32, builtin_step=True)
    assert found.counts_items and seen == {"meta"}


def test_the_stand_in_row_of_sharded_parameters_is_on_the_models_device():
    """Sharded parameters (``gathers_parameters``): a worker without rows runs the chief's first row, labels
    included, on its model's device (FSDP's hook moves the inputs, not the labels). The model on torch's ``meta``
    device stands for an accelerator; the cluster is a stand-in for 2 workers (the chief's view)."""

    class TwoWorkers:
        num_workers, is_chief = 2, True

        def broadcast(self, value, what):
            return value

        def any(self, value, what):
            return bool(value)

        def all_gather(self, value, what):
            return [value, value]

    trainer = Trainer(loss="cross_entropy", metrics=())
    checks = trainer._input_checks
    checks._strategy = types.SimpleNamespace(cluster=TwoWorkers())
    dm = types.SimpleNamespace(module=torch.nn.Linear(4, 3, device="meta"), gathers_parameters=True)
    found = checks.check_first_batch((X[:5], Y[:5]), dm, "fit()", float_dtype=torch.float32, builtin_step=True)
    assert [t.device.type for t in found.stand_in] == ["meta", "meta"]
