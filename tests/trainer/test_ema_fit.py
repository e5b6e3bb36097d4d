"""Moving averages of the weights in ``Trainer.fit``: the model ends with the averages (Keras' fit calls
``finalize_variable_values``), ``SwapEMAWeights`` validates and keeps the averages, a resumed run equals
the uninterrupted one, and recipes take ``use_ema`` and ``exclude_from_weight_decay``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import InterruptAt, make_strategy

from replicafit import optimizers, recipes
from replicafit.recipes import RecipeError
from replicafit.trainer import BackupAndRestore, Callback, EarlyStopping, SwapEMAWeights, Trainer

pytestmark = pytest.mark.timeout(120)

generator = torch.Generator().manual_seed(0)
X = torch.randn(200, 6, generator=generator)
Y = (X[:, 0] + X[:, 1] > 0).long()
VALIDATION = (X[160:], Y[160:])
TRAIN = (X[:160], Y[:160])


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def make_optimizer(kind="adamw"):
    if kind == "torch":
        optimizer = optimizers.from_torch(torch.optim.AdamW, lr=0.02, weight_decay=0.1, use_ema=True, ema_momentum=0.8)
    else:
        optimizer = optimizers.AdamW(0.02, weight_decay=0.1, use_ema=True, ema_momentum=0.8)
    optimizer.exclude_from_weight_decay(var_names=["bias", "1.weight"])
    return optimizer


def averages(optimizer) -> list:
    return [entry["average"] for _, entry in sorted(optimizer.state_dict()["slots"].items())]


class Snapshots(Callback):
    """The model's parameters when each validation runs and when each epoch's training resumes."""

    def __init__(self):
        super().__init__()
        self.validated, self.trained = [], []

    def on_test_begin(self, logs=None):
        self.validated.append([p.detach().clone() for p in self.model.parameters()])

    def on_epoch_end(self, epoch, logs=None):
        self.trained.append(averages(self.trainer.optimizer))


def fit(strategy, optimizer, callbacks=(), epochs=3):
    model = make_model()
    trainer = Trainer(strategy=make_strategy(strategy), optimizer=optimizer, metrics=["accuracy"], seed=0)
    history = trainer.fit(
        model, TRAIN, batch_size=32, epochs=epochs, validation_data=VALIDATION, verbose=0, callbacks=list(callbacks)
    )
    return trainer, model, history


@pytest.mark.parametrize("kind", ["adamw", "torch"])
@pytest.mark.parametrize("strategy", ["default", "mirrored2", "central_storage2"])
def test_the_model_ends_with_the_averages(strategy, kind):
    trainer, model, _ = fit(strategy, make_optimizer(kind))
    for parameter, average in zip(model.parameters(), averages(trainer.optimizer)):
        assert torch.equal(parameter.detach(), average)
    reference, reference_model, _ = fit("default", make_optimizer(kind))
    for a, b in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_swap_ema_weights_validates_on_the_averages_and_trains_on_the_weights(strategy):
    snapshots = Snapshots()
    trainer, model, history = fit(strategy, make_optimizer(), callbacks=[SwapEMAWeights(), snapshots])
    # each validation saw that epoch's averages
    for seen, epoch_averages in zip(snapshots.validated, snapshots.trained):
        assert all(torch.equal(a, b) for a, b in zip(seen, epoch_averages))
    # the last validation's figures are the final (averaged) model's
    final = trainer.evaluate(model, VALIDATION, batch_size=32, verbose=0, return_dict=True)
    assert final["loss"] == history.history["val_loss"][-1]
    # training went on from the trained weights: the same run without the callback ends identically
    _, plain_model, plain_history = fit(strategy, make_optimizer())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    assert plain_history.history["loss"] == history.history["loss"]
    assert plain_history.history["val_loss"] != history.history["val_loss"]  # validated the weights instead


def test_swap_ema_weights_on_epoch_lets_early_stopping_keep_the_best_averages():
    snapshots = Snapshots()
    stop = EarlyStopping(monitor="val_accuracy", patience=10, restore_best_weights=True)
    _, model, history = fit(
        "mirrored2", make_optimizer(), callbacks=[SwapEMAWeights(swap_on_epoch=True), stop, snapshots], epochs=4
    )
    best = history.history["val_accuracy"].index(max(history.history["val_accuracy"]))
    assert all(torch.equal(p.detach(), a) for p, a in zip(model.parameters(), snapshots.trained[best]))


def test_swap_ema_weights_without_averages_says_what_to_do():
    with pytest.raises(ValueError, match="use_ema=True"):
        fit("default", optimizers.Adam(0.01), callbacks=[SwapEMAWeights()])


@pytest.mark.parametrize("strategy", ["default", "mirrored2"])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, strategy):
    def callbacks(*more):
        return [SwapEMAWeights(swap_on_epoch=True), BackupAndRestore(tmp_path / "backup"), *more]

    reference, reference_model, reference_history = fit(strategy, make_optimizer(), callbacks())
    # 5 steps per epoch: the crash comes in the third epoch, after the second epoch's backup, which
    # was written while the averages were in the model
    with pytest.raises(KeyboardInterrupt):
        fit(strategy, make_optimizer(), callbacks(InterruptAt(12)))
    trainer, model, history = fit(strategy, make_optimizer(), callbacks())
    assert history.history == reference_history.history
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference_model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(averages(trainer.optimizer), averages(reference.optimizer)))


@pytest.mark.timeout(300)
def test_the_digits_recipe_with_use_ema_reaches_95_percent_and_ends_with_averages():
    overrides = ["optimizer.use_ema=true", "optimizer.exclude_from_weight_decay=[bias]", "fit.verbose=0"]
    recipe = recipes.load("digits_mlp", overrides=overrides)
    run = recipes.build(recipe)
    assert isinstance(run.callbacks[0], SwapEMAWeights) and run.callbacks[0].swap_on_epoch
    snapshots = Snapshots()
    history = run.trainer.fit(run.model, run.train, callbacks=[*run.callbacks, snapshots], **run.fit_kwargs)
    accuracy = history.history["val_accuracy"]
    assert max(accuracy) >= 0.95, accuracy
    assert len(run.trainer.optimizer._weight_decay.excluded) == 2  # both biases
    # the recipe restores the best epoch's weights, which were that epoch's averages
    best = accuracy.index(max(accuracy))
    assert all(torch.equal(p.detach(), a) for p, a in zip(run.model.parameters(), snapshots.trained[best]))


def test_a_recipe_that_lists_swap_ema_weights_decides_itself():
    recipe = recipes.load(
        "digits_mlp",
        overrides=["optimizer.use_ema=true", "callbacks=[{type: swap_ema_weights}]", "fit.epochs=1"],
    )
    run = recipes.build(recipe)
    swaps = [c for c in run.callbacks if isinstance(c, SwapEMAWeights)]
    assert len(swaps) == 1 and not swaps[0].swap_on_epoch


@pytest.mark.parametrize(
    "value, message",
    [("3", "expected a list of name parts"), ("[bias, '']", "non-empty string")],
)
def test_recipe_exclusions_are_checked(value, message):
    recipe = recipes.load("digits_mlp", overrides=[f"optimizer.exclude_from_weight_decay={value}"])
    with pytest.raises(RecipeError, match=message):
        recipes.validate(recipe)


def test_list_shows_the_optimizer_arguments():
    listing = subprocess.run(
        [sys.executable, "-m", "replicafit.trainer", "list", "optimizer"], capture_output=True, text=True, timeout=60
    )
    assert listing.returncode == 0, listing.stderr
    names = ("beta_1", "amsgrad", "use_ema", "ema_momentum", "ema_overwrite_frequency", "exclude_from_weight_decay")
    for name in names:
        assert name in listing.stdout, listing.stdout
