"""A callback's ``monitor`` that the logs lack (issue 16): a warning once per fit at run time, as Keras warns,
and a recipe error from ``replicafit validate`` (and the validation ``fit`` runs first).

At run time ``EarlyStopping``, ``ModelCheckpoint(save_best_only=True)``, ``ReduceLROnPlateau`` and
``TorchLRScheduler``'s ``ReduceLROnPlateau`` warn at the first epoch (or step) whose logs lack the name,
listing the logged names and a close one, and otherwise leave that epoch alone, as before.
"""

from __future__ import annotations

import re
import textwrap
import types
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from replicafit import cli, optimizers
from replicafit.trainer import (
    EarlyStopping,
    ModelCheckpoint,
    ReduceLROnPlateau,
    TorchLRScheduler,
    Trainer,
)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SHIPPED = sorted(RECIPES.glob("*.yaml"))


# --- run time -----------------------------------------------------------------------------------
def make_data(n: int = 32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=generator)
    return x, (x[:, 0] > 0).long()


def make_model() -> torch.nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def fit(callbacks, validation_split=0.25, epochs=3, optimizer=None, model=None):
    """Fits a tiny classifier; returns ``(the monitor warnings raised, the trainer)``."""
    trainer = Trainer(optimizer=optimizer or optimizers.SGD(0.1), metrics=["accuracy"], seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(
            model or make_model(),
            make_data(),
            batch_size=8,
            epochs=epochs,
            validation_split=validation_split,
            callbacks=callbacks,
            verbose=0,
        )
    found = [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "monitors" in str(w.message)]
    return found, trainer


CALLBACKS = {
    "early_stopping": lambda monitor, tmp: EarlyStopping(monitor=monitor, patience=1),
    "model_checkpoint": lambda monitor, tmp: ModelCheckpoint(
        str(tmp / "best.pt"), monitor=monitor, save_best_only=True, save_weights_only=True
    ),
    "reduce_lr_on_plateau": lambda monitor, tmp: ReduceLROnPlateau(monitor=monitor, patience=0),
    "torch_lr_scheduler": lambda monitor, tmp: TorchLRScheduler("ReduceLROnPlateau", monitor=monitor, patience=0),
}
WHO = {
    "early_stopping": "EarlyStopping",
    "model_checkpoint": "ModelCheckpoint(save_best_only=True)",
    "reduce_lr_on_plateau": "ReduceLROnPlateau",
    "torch_lr_scheduler": "TorchLRScheduler(ReduceLROnPlateau)",
}


@pytest.mark.parametrize("kind", CALLBACKS)
def test_a_missing_monitor_warns_once_per_fit_with_the_close_name(tmp_path, kind):
    callback = CALLBACKS[kind]("val_acc", tmp_path)
    for _ in range(2):  # the same callback in a second fit says it again, once
        found, trainer = fit([callback])
        assert len(found) == 1, found
        message = found[0]
        assert message.startswith(f"{WHO[kind]} monitors 'val_acc', which is not in the logs"), message
        assert "(did you mean 'val_accuracy'?)" in message
        assert re.search(r"available: loss, accuracy, val_loss, val_accuracy\b", message), message
    if kind in ("reduce_lr_on_plateau", "torch_lr_scheduler"):  # otherwise unchanged: the rate is left alone
        assert float(trainer.optimizer.learning_rate) == pytest.approx(0.1)
    if kind == "model_checkpoint":
        assert not (tmp_path / "best.pt").exists()


@pytest.mark.parametrize("kind", CALLBACKS)
def test_only_the_callback_whose_monitor_is_missing_warns(tmp_path, kind):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    present = CALLBACKS[kind]("val_accuracy", tmp_path / "a")
    missing = CALLBACKS[kind]("val_acc", tmp_path / "b")
    found, _ = fit([present, missing])
    assert len(found) == 1, found
    assert "'val_acc'" in found[0] and "(did you mean 'val_accuracy'?)" in found[0]
    if kind == "model_checkpoint":
        assert (tmp_path / "a" / "best.pt").exists() and not (tmp_path / "b" / "best.pt").exists()


def test_a_val_monitor_without_validation_says_to_validate():
    found, _ = fit([EarlyStopping(monitor="val_loss")], validation_split=0.0)
    assert found == [
        "EarlyStopping monitors 'val_loss', which is not in the logs (no validation ran: pass validation_data or "
        "validation_split to fit, or monitor 'loss'); available: loss, accuracy. Training does not stop early "
        "while it is missing."
    ]


@pytest.mark.parametrize(
    "callback, setting",
    [
        (lambda tmp: TorchLRScheduler("ReduceLROnPlateau", interval="step", monitor="val_loss"), "interval='epoch'"),
        (
            lambda tmp: ModelCheckpoint(str(tmp / "b.pt"), monitor="val_loss", save_best_only=True, save_freq=2),
            "save_freq='epoch'",
        ),
    ],
    ids=["torch_lr_scheduler", "model_checkpoint"],
)
def test_a_val_monitor_read_every_step_says_a_step_has_no_val_values(tmp_path, callback, setting):
    found, _ = fit([callback(tmp_path)])
    assert len(found) == 1, found
    assert f"a step's logs have no val_ values, validation runs at each epoch's end: set {setting}" in found[0]
    assert "available: loss, accuracy." in found[0]


@pytest.mark.parametrize("chief", [True, False])
def test_only_the_chief_warns(chief):
    """On a worker other than the chief (``should_checkpoint`` False) nothing is said: the logs are global, so
    the chief's one warning speaks for every worker."""
    stopper = EarlyStopping(monitor="val_acc")
    stopper.set_trainer(
        types.SimpleNamespace(strategy=types.SimpleNamespace(extended=types.SimpleNamespace(should_checkpoint=chief)))
    )
    stopper.on_train_begin()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            stopper.on_epoch_end(epoch, {"loss": 1.0, "val_accuracy": 0.5})
    assert len(caught) == (1 if chief else 0)
    assert stopper._monitor_warned  # said (or left to the chief) once: never again in this fit


# --- recipes ------------------------------------------------------------------------------------
CLASSIFICATION = """
  type: classification
  n_samples: 64
  n_features: 4
  n_classes: 3
  validation_split: {split}"""

HEAD = """
seed: 0
strategy: one_device
data:{data}
model:
{model}
loss: cross_entropy
metrics: {metrics}
fit:
  epochs: 1
  batch_size: 16
  verbose: 0
callbacks:
"""


def recipe(tmp_path, callbacks: str, split=0.25, metrics="[accuracy]", model="  type: mlp\n  hidden: [8]"):
    """A small classification recipe with these callback entries (YAML list items)."""
    path = tmp_path / "recipe.yaml"
    head = HEAD.format(data=CLASSIFICATION.format(split=split), model=model, metrics=metrics)
    path.write_text(head + textwrap.indent(textwrap.dedent(callbacks).strip("\n"), "  ") + "\n")
    return path


def validate(capsys, path, *argv, command="validate"):
    status = cli.main([command, str(path), *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def assert_ok(capsys, path, *argv) -> None:
    status, out, err = validate(capsys, path, *argv)
    assert (status, out, err) == (0, f"{path}: ok\n", "")


def recipe_error(capsys, path, key: str, text: str, *argv, command="validate") -> str:
    """Validates the recipe at ``path``, expecting one error at ``key``, on the first line containing ``text``;
    returns the message."""
    status, out, err = validate(capsys, path, *argv, command=command)
    assert status == 2, (out, err)
    assert "Traceback" not in err
    line = next(n for n, row in enumerate(path.read_text().splitlines(), start=1) if text in row)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    prefix = f"error: {path}:{line}: {key}: "
    assert lines[0].startswith(prefix), (prefix, lines[0])
    return lines[0][len(prefix) :]


def test_validate_refuses_an_unknown_monitor_with_the_close_name(tmp_path, capsys):
    path = recipe(tmp_path, "- type: early_stopping\n  monitor: val_acc\n  patience: 2\n")
    message = recipe_error(capsys, path, "callbacks[0].monitor", "monitor: val_acc")
    assert message == (
        "'early_stopping' monitors 'val_acc', which this recipe's fit does not log (did you mean 'val_accuracy'?): "
        "training would never stop early; logged: loss, accuracy, val_loss, val_accuracy"
    )
    # fit validates first: the same message, before anything is built or trained
    assert recipe_error(capsys, path, "callbacks[0].monitor", "monitor: val_acc", command="fit") == message


def test_validate_explains_a_val_monitor_without_validation(tmp_path, capsys):
    path = recipe(tmp_path, "- {type: early_stopping, monitor: val_accuracy}", split=0.0)
    message = recipe_error(capsys, path, "callbacks[0].monitor", "val_accuracy")
    assert message == (
        "'early_stopping' monitors 'val_accuracy', but the recipe has no validation data, so fit logs no val_ "
        "values: add fit.validation_split (e.g. 0.2) or data.validation_split (e.g. 0.2), or monitor one of the "
        "values fit logs: loss, accuracy"
    )
    # the default monitor (val_loss) is checked too, at the callback's entry
    path = recipe(tmp_path, "- type: reduce_lr_on_plateau\n  factor: 0.5", split=0.0)
    message = recipe_error(capsys, path, "callbacks[0]", "type: reduce_lr_on_plateau")
    assert message.startswith("'reduce_lr_on_plateau' monitors 'val_loss' (its default), but the recipe has no")
    assert message.endswith("values fit logs: loss, accuracy, learning_rate")  # it logs the rate itself
    # fit.validation_split: 0 turns the data's validation set off
    path = recipe(tmp_path, "- {type: early_stopping, monitor: val_loss}")
    message = recipe_error(capsys, path, "callbacks[0].monitor", "val_loss", "--set", "fit.validation_split=0")
    assert "fit.validation_split is 0 (which also leaves the data's validation set out)" in message
    assert_ok(capsys, path, "--set", "fit.validation_split=0.2")


def test_validate_checks_every_builtin_callback_that_monitors(tmp_path, capsys):
    cases = [
        ("- {type: reduce_lr_on_plateau, monitor: val_los}", "'val_loss'", "the learning rate would never be reduced"),
        (
            "- {type: model_checkpoint, filepath: b.pt, save_best_only: true, monitor: acuracy}",
            "'accuracy'",
            "no checkpoint would ever be saved",
        ),
        (
            "- {type: torch_lr_scheduler, factory: ReduceLROnPlateau, monitor: val_acc, patience: 1}",
            "'val_accuracy'",
            "the learning rate would never be reduced",
        ),
    ]
    for callbacks, close, consequence in cases:
        path = recipe(tmp_path, callbacks)
        message = recipe_error(capsys, path, "callbacks[0].monitor", "monitor")
        assert f"(did you mean {close}?): {consequence}; logged: loss, accuracy, val_loss, val_accuracy" in message
    # a monitor that does nothing is not checked: ModelCheckpoint without save_best_only, other schedulers
    path = recipe(
        tmp_path,
        """
        - {type: model_checkpoint, filepath: b.pt, monitor: acuracy}
        - {type: torch_lr_scheduler, factory: StepLR, step_size: 2, monitor: val_acc}
        """,
    )
    assert_ok(capsys, path)


@pytest.mark.parametrize(
    "callbacks, setting",
    [
        ("- {type: torch_lr_scheduler, factory: ReduceLROnPlateau, interval: step}", "interval: epoch"),
        ("- {type: model_checkpoint, filepath: b.pt, save_best_only: true, save_freq: 2}", "save_freq: epoch"),
    ],
    ids=["torch_lr_scheduler", "model_checkpoint"],
)
def test_validate_refuses_a_val_monitor_read_every_step(tmp_path, capsys, callbacks, setting):
    message = recipe_error(capsys, recipe(tmp_path, callbacks), "callbacks[0]", "- {type:")
    assert "monitors 'val_loss' (its default), but" in message
    assert f"a step's logs have no val_ values (validation runs at each epoch's end): set {setting}" in message
    assert message.endswith("or monitor a value of the training steps (loss, accuracy)")


def test_validate_knows_the_names_metrics_are_logged_under(tmp_path, capsys):
    """``acc`` is logged as ``accuracy``, a built-in metric under the name the recipe writes, or its ``name``."""
    metrics = "[acc, sparse_categorical_accuracy, {type: sparse_categorical_crossentropy, name: xent}]"
    monitors = "- {type: early_stopping, monitor: val_xent}\n- {type: early_stopping, monitor: val_accuracy}"
    assert_ok(capsys, recipe(tmp_path, monitors, metrics=metrics))
    path = recipe(tmp_path, "- {type: early_stopping, monitor: val_xnet}", metrics=metrics)
    message = recipe_error(capsys, path, "callbacks[0].monitor", "monitor")
    assert "(did you mean 'val_xent'?)" in message
    assert message.endswith(
        "logged: loss, accuracy, sparse_categorical_accuracy, xent, val_loss, val_accuracy, "
        "val_sparse_categorical_accuracy, val_xent"
    )


def test_validate_learning_rate_only_after_a_callback_that_logs_it(tmp_path, capsys):
    before = "- {type: reduce_lr_on_plateau, monitor: val_loss}\n- {type: early_stopping, monitor: learning_rate}"
    assert_ok(capsys, recipe(tmp_path, before))
    after = "- {type: early_stopping, monitor: learning_rate}\n- {type: reduce_lr_on_plateau, monitor: val_loss}"
    message = recipe_error(capsys, recipe(tmp_path, after), "callbacks[0].monitor", "learning_rate")
    assert message.endswith("which a callback listed after this one logs: list that callback before this one")
    without = "- {type: early_stopping, monitor: learning_rate}"
    message = recipe_error(capsys, recipe(tmp_path, without), "callbacks[0].monitor", "learning_rate")
    assert "which this recipe's fit does not log" in message


USER_CODE = """
import torch
from replicafit.trainer.callbacks import Callback
from replicafit.trainer.metrics import MeanAbsoluteError

class F1(MeanAbsoluteError):
    pass

class Logs(Callback):
    pass

def model(inputs=4, outputs=3):
    return torch.nn.Linear(inputs, outputs)
"""


def test_validate_does_not_guess_names_only_user_code_knows(tmp_path, capsys, monkeypatch):
    """A ``module:attr`` metric's name, or what a user callback adds to the logs, is known only by calling them
    (validate does not): an unknown monitor is then let through. A user model may have several outputs
    (``<output>_accuracy``). A val_ monitor without validation is refused all the same."""
    package = f"monitor_checks_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{package}.py").write_text(USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert_ok(capsys, recipe(tmp_path, "- {type: early_stopping, monitor: val_f1}", metrics=f"['{package}:F1']"))
    assert_ok(capsys, recipe(tmp_path, f"- '{package}:Logs'\n- {{type: early_stopping, monitor: val_custom}}"))
    user_model = f"  type: '{package}:model'"
    assert_ok(capsys, recipe(tmp_path, "- {type: early_stopping, monitor: val_head_accuracy}", model=user_model))
    path = recipe(tmp_path, "- {type: early_stopping, monitor: val_acc}", model=user_model)
    assert "(did you mean 'val_accuracy'?)" in recipe_error(capsys, path, "callbacks[0].monitor", "val_acc")
    path = recipe(tmp_path, "- {type: early_stopping, monitor: val_f1}", split=0.0, metrics=f"['{package}:F1']")
    assert "has no validation data" in recipe_error(capsys, path, "callbacks[0].monitor", "val_f1")


def shipped_monitors(path) -> list:
    """``(index, monitor)`` of each callback entry of a shipped recipe that names a monitor."""
    entries = yaml.safe_load(path.read_text()).get("callbacks") or []
    return [(i, e["monitor"]) for i, e in enumerate(entries) if isinstance(e, dict) and "monitor" in e]


def test_every_shipped_recipe_validates_and_its_monitors_are_checked(capsys):
    """Each shipped recipe still validates; a monitor of theirs misspelt is refused with the recipe's name for it."""
    assert len(SHIPPED) >= 5
    for path in SHIPPED:
        assert_ok(capsys, path)
    monitors = [(path, index, monitor) for path in SHIPPED for index, monitor in shipped_monitors(path)]
    assert {path.stem for path, _, _ in monitors} >= {"digits_mlp", "regression"}
    for path, index, monitor in monitors:
        status, _, err = validate(capsys, path, "--set", f"callbacks.{index}.monitor={monitor}x")
        assert status == 2 and f"callbacks[{index}].monitor" in err and f"(did you mean {monitor!r}?)" in err, err
