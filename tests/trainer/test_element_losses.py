"""Element-level losses (a prediction per token or pixel, some ignored or weighted): the step's loss is the
loss's own mean over the whole global batch, under every strategy, across workers and accumulation
windows, against a plain torch loop; and the metrics count real elements the same way."""

from __future__ import annotations

import copy

import element_scenarios as scenarios
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import InterruptAt, make_strategy
from multiworker_harness import results, run_workers

from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Callback, Trainer, losses, metrics

TOLERANCE = 2e-6
STRATEGIES = ["default", "mirrored2", "mirrored3", "central_storage2"]


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("case", scenarios.CASES)
def test_the_steps_of_a_plain_torch_loop_under_every_strategy(case, name):
    """Batches of 8 over 30 rows (a partial last batch; Mirrored(3) splits 8 as 3, 3, 2)."""
    expected = scenarios.oracle(case, batch_size=8)
    got = scenarios.ours(case, make_strategy(name), batch_size=8)
    assert scenarios.largest_difference(got["weights"], expected) <= TOLERANCE


@pytest.mark.parametrize("name", ["default", "mirrored2"])
@pytest.mark.parametrize("case", scenarios.CASES)
def test_accumulation_windows_of_micro_batches_equal_one_big_batch(case, name):
    """Windows of 4 micro-batches of 2 take the steps of batches of 8: the window divides by its own real
    elements, whatever the micro-batches had (the partial last window too)."""
    expected = scenarios.oracle(case, batch_size=8)
    got = scenarios.ours(case, make_strategy(name), batch_size=2, accumulation=4)
    assert scenarios.largest_difference(got["weights"], expected) <= TOLERANCE


@pytest.mark.timeout(120)
@pytest.mark.parametrize("batch_size,accumulation", [(8, None), (29, None), (2, 4)])
def test_two_workers_take_the_steps_of_a_plain_torch_loop(batch_size, accumulation):
    """Batches of 29 of 30 rows: the last global batch has one row, so worker 1's replica is empty. Windows
    of 4 micro-batches of 2 take the steps of batches of 8."""
    kwargs = {"batch_size": batch_size, "accumulation": accumulation}
    workers = results(run_workers(scenarios.__file__, "two_workers", 2, timeout=100, kwargs=kwargs))
    for case in scenarios.CASES:
        expected = scenarios.oracle(case, batch_size=batch_size * (accumulation or 1))
        for worker, got in enumerate(workers):
            assert scenarios.largest_difference(got[case]["weights"], expected) <= TOLERANCE, (case, worker)
        assert workers[0][case]["history"] == workers[1][case]["history"]


def test_the_logged_loss_is_the_mean_over_every_real_element_of_the_data():
    model, (x, y), loss, torch_loss, _ = scenarios.case("ignore_index")
    trainer = Trainer(strategy=make_strategy("mirrored3"), loss=loss, metrics=[])
    logs = trainer.evaluate(model, (x, y), batch_size=7, return_dict=True)
    with torch.no_grad():
        expected = torch_loss(model(x), y)
    assert abs(logs["loss"] - float(expected)) < 1e-6


def test_accuracy_on_classes_second_counts_only_real_tokens():
    """``"accuracy"`` with ``(N, C, L)`` outputs and a torch loss: the share of real tokens predicted right."""
    model, (x, y), loss, _, _ = scenarios.case("ignore_index")
    trainer = Trainer(strategy=make_strategy("mirrored2"), loss=loss, metrics=["accuracy"])
    logs = trainer.evaluate(model, (x, y), batch_size=8, return_dict=True)
    with torch.no_grad():
        predicted = model(x).argmax(dim=1)
    real = y != -100
    expected = float((predicted == y)[real].float().sum() / real.sum())
    assert abs(logs["accuracy"] - expected) < 1e-6
    assert isinstance(trainer._compile_metrics.metrics[0], metrics.SparseCategoricalAccuracy)


def test_accuracy_on_classes_last_with_ignore_class():
    model, (x, y), loss, _, _ = scenarios.case("ignore_class")
    logs = Trainer(loss=loss).evaluate(model, (x, y), batch_size=8, return_dict=True)
    with torch.no_grad():
        predicted = model(x).argmax(dim=-1)
    real = y != -100
    assert abs(logs["accuracy"] - float((predicted == y)[real].float().mean())) < 1e-6


def test_a_global_batch_with_no_real_element_gives_a_zero_gradient_and_logs_no_loss():
    model, (x, y), loss, _, _ = scenarios.case("ignore_index")
    y = torch.full_like(y, -100)
    before = copy.deepcopy(model.state_dict())
    trainer = Trainer(strategy=make_strategy("mirrored2"), optimizer=optimizers.SGD(0.5), loss=loss, metrics=[])
    history = trainer.fit(model, (x, y), batch_size=8, verbose=0, shuffle=False)
    assert scenarios.largest_difference(model.state_dict(), before) == 0.0
    assert history.history["loss"] == [0.0]  # not NaN: no element, no loss


def test_sample_weights_per_example_and_per_element_multiply_and_never_divide():
    """Keras 3's rule: Σ sample_weight * loss over real elements / the count of real elements."""
    model, (x, y), loss, _, _ = scenarios.case("ignore_class")
    generator = torch.Generator().manual_seed(3)
    for weights in (torch.rand(len(x), generator=generator), torch.rand(*y.shape, generator=generator)):
        trainer = Trainer(strategy=make_strategy("mirrored2"), loss=loss, metrics=[])
        logs = trainer.evaluate(model, (x, y, weights), batch_size=8, return_dict=True)
        with torch.no_grad():
            values = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
        real = y != -100
        full = weights if weights.dim() == 2 else weights[:, None].expand_as(y)
        expected = float((values * full)[real].sum() / real.sum())
        assert abs(logs["loss"] - expected) < 1e-6


def test_negative_labels_without_ignore_class_are_an_error():
    model, (x, y), _, _, _ = scenarios.case("ignore_class")
    with pytest.raises(ValueError, match="Labels out of range"):
        Trainer(loss="sparse_categorical_crossentropy").fit(model, (x, y), batch_size=8, verbose=0)


def test_ignore_class_must_be_an_int():
    with pytest.raises(TypeError, match="ignore_class must be None or an int"):
        losses.SparseCategoricalCrossentropy(ignore_class="pad")


def test_a_loss_of_ones_own_returns_element_losses():
    """The public contract for callables: ``ElementLosses(values, weights)``."""

    def token_loss(y_true, y_pred):
        real = y_true != -100
        values = F.cross_entropy(y_pred.movedim(-1, 1), y_true.where(real, 0), reduction="none")
        return losses.ElementLosses(values, weights=real)

    expected = scenarios.oracle("ignore_class", batch_size=8)
    model, data, _, _, _ = scenarios.case("ignore_class")
    optimizer = optimizers.SGD(0.5, momentum=0.5)
    trainer = Trainer(strategy=make_strategy("mirrored3"), optimizer=optimizer, loss=token_loss, metrics=[], seed=0)
    trainer.fit(model, data, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert scenarios.largest_difference(model.state_dict(), expected) <= TOLERANCE


def test_per_example_losses_keep_the_global_batch_size_as_divisor_and_need_no_step_value():
    """A per-example loss sets no gradient denominator: the fast path of before."""
    trainer = Trainer(loss="cross_entropy", metrics=[])
    model = nn.Linear(6, scenarios.CLASSES)
    x, y = scenarios.classifier_data()
    seen = []
    original = optimizers.SGD._divisor

    def spy(self, strategy, weight):
        seen.append(self.gradient_denominator)
        return original(self, strategy, weight)

    optimizers.SGD._divisor = spy
    try:
        trainer.optimizer = optimizers.SGD(0.1)
        trainer.fit(model, (x, y), batch_size=8, verbose=0)
    finally:
        optimizers.SGD._divisor = original
    assert seen and all(d is None for d in seen)


def test_float16_element_sums_are_prescaled_so_the_loss_scale_is_not_cut():
    """Under "16-mixed" each replica divides its sum by a constant before backward: the loss scaler sees
    gradients in the mean's range and skips no step for the sum's size."""
    model, data, loss, _, _ = scenarios.case("ignore_index")
    trainer = Trainer(
        strategy=make_strategy("mirrored2"), optimizer=optimizers.SGD(0.1), loss=loss, precision="16-mixed"
    )
    trainer.fit(model, data, batch_size=8, verbose=0)
    assert trainer.optimizer.dynamic_scale == 2.0**15
    assert trainer.optimizer.gradient_denominator is None  # cleared when fit ends


@pytest.mark.parametrize("name", ["default", "mirrored2"])
def test_a_backup_mid_window_keeps_the_windows_real_elements(tmp_path, name):
    """Backups every 3 steps of windows of 4: the resumed window divides by the real elements of its steps
    before the backup too, so the resumed run equals the uninterrupted one."""

    def run(callbacks=()):
        model, data, loss, _, _ = scenarios.case("ignore_index")
        optimizer = optimizers.SGD(0.5, momentum=0.5, gradient_accumulation_steps=4)
        trainer = Trainer(strategy=make_strategy(name), optimizer=optimizer, loss=loss, metrics=[], seed=0)
        trainer.fit(model, data, batch_size=2, epochs=2, shuffle=False, verbose=0, callbacks=list(callbacks))
        return model.state_dict()

    reference = run()
    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        run([BackupAndRestore(backup, save_freq=3), InterruptAt(21)])  # 15 steps per epoch: mid-window
    resumed = run([BackupAndRestore(backup, save_freq=3)])
    assert scenarios.largest_difference(resumed, reference) <= 1e-6


def test_a_recipe_names_ignore_class():
    from replicafit import recipes

    recipe = recipes.load(
        "digits_mlp", overrides=["loss.type=sparse_categorical_crossentropy", "loss.ignore_class=-100"]
    )
    loss = recipes.build(recipe).trainer.loss
    assert isinstance(loss, losses.SparseCategoricalCrossentropy) and loss.ignore_class == -100
    with pytest.raises(Exception, match="ignore_class"):
        recipes.build(recipes.load("digits_mlp", overrides=["loss.type=cross_entropy", "loss.ignore_class=pad"]))


@pytest.mark.timeout(120)
def test_the_count_of_real_elements_costs_no_collective_of_its_own():
    """Across workers a step of an element-level loss makes as many collectives as a per-example one: the
    count rides with the gradient reduction."""
    workers = results(run_workers(scenarios.__file__, "collectives_per_step", 2, timeout=100))
    for got in workers:
        assert got["element"] == got["per_example"] and len(got["element"]) == 4, got


def test_a_train_step_of_ones_own_that_calls_the_built_in_one_reduces_per_example():
    """fit cannot know that an override adds the step value: such a step reduces per example, as before."""

    class Logged(Trainer):
        def train_step(self, data):
            super().train_step(data)

    x, y = scenarios.classifier_data()
    trainer = Logged(loss=nn.CrossEntropyLoss(), metrics=[])
    history = trainer.fit(nn.Linear(6, scenarios.CLASSES), (x, y), batch_size=8, verbose=0)
    assert history.history["loss"][0] > 0


def test_float16_losses_are_summed_in_float32():
    """Squared errors near 3600 over 64 rows overflow a float16 sum; the logged loss must not."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.full((64, 4), 60.0)
    trainer = Trainer(optimizer=optimizers.SGD(1e-4), loss="mse", metrics=[], precision="16-mixed", seed=0)
    history = trainer.fit(nn.Linear(8, 4), (x, y), batch_size=64, verbose=0)
    assert 3000 < history.history["loss"][0] < 4000


def test_per_example_weights_of_shape_batch_by_one_weigh_as_per_example_weights():
    torch.manual_seed(0)
    x, y, w = torch.randn(16, 3), torch.randn(16, 2, 5), torch.rand(16)
    results = []
    for weights in (w, w[:, None]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 10), nn.Unflatten(1, (2, 5)))
        Trainer(optimizer=optimizers.SGD(0.1), loss="mse", metrics=[]).fit(
            model, (x, y, weights), batch_size=8, shuffle=False, verbose=0
        )
        results.append(model.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_a_fit_interrupted_mid_window_goes_on_with_the_windows_count():
    """The window stays open in the optimizer after an exception, and so does its count of real elements."""

    class Interrupt(Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyboardInterrupt

    def trainer():
        return Trainer(optimizer=optimizers.SGD(0.5, gradient_accumulation_steps=2), loss=loss, metrics=[], seed=0)

    model, (x, y), loss, _, _ = scenarios.case("ignore_class")
    trainer().fit(model, (x[:8], y[:8]), batch_size=4, shuffle=False, verbose=0)
    expected = copy.deepcopy(model.state_dict())
    model, (x, y), loss, _, _ = scenarios.case("ignore_class")
    interrupted = trainer()
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(model, (x[:4], y[:4]), batch_size=4, shuffle=False, verbose=0, callbacks=[Interrupt()])
    assert interrupted.optimizer.gradient_denominator is None and interrupted.optimizer.accumulated_steps == 1
    interrupted.fit(model, (x[4:8], y[4:8]), batch_size=4, shuffle=False, verbose=0)
    assert scenarios.largest_difference(model.state_dict(), expected) <= 1e-7


def test_a_count_of_real_elements_rides_as_an_integer_and_class_weights_as_a_float():
    for loss, floating in ((nn.CrossEntropyLoss(), False), (nn.CrossEntropyLoss(weight=scenarios.CLASS_WEIGHTS), True)):
        trainer = Trainer(loss=loss, metrics=[])
        x, y = scenarios.classifier_data()
        trainer.fit(nn.Linear(6, scenarios.CLASSES), (x, y), batch_size=8, verbose=0)
        assert trainer._compile_loss.count_floating is floating
