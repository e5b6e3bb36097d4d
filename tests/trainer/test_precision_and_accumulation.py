"""``Trainer(precision=...)`` and ``gradient_accumulation_steps`` through fit, evaluate, predict
and recipes: autocast in every replica's forward and loss, float32 variables and gradients, the
digits recipe at >= 95% with each."""

from __future__ import annotations

import pytest
import torch
from conftest import make_strategy

from replicafit import optimizers, recipes
from replicafit.recipes.loader import RecipeError
from replicafit.trainer import Trainer

X = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
Y = (X[:, 0] > 0).long()


def make_model():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
@pytest.mark.parametrize("strategy", ["default", "mirrored2", "central_storage2", "multi_worker1x2"])
def test_every_replica_computes_in_half_precision_and_keeps_float32_state(precision, dtype, strategy):
    model = make_model()
    seen = []
    # (the trainer's one-example probe of the outputs' structure runs as it is: rows > 1 are the steps)
    model[0].register_forward_hook(
        lambda module, inputs, output: seen.append((output.dtype, torch.is_grad_enabled())) if len(output) > 1 else None
    )
    trainer = Trainer(strategy=make_strategy(strategy), optimizer="sgd", loss="cross_entropy", precision=precision)
    history = trainer.fit(model, (X, Y), batch_size=16, epochs=1, verbose=0)
    training = [d for d, grad in seen if grad]
    assert training and set(training) == {dtype}  # every replica's forward, every step
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert history.history["loss"][0] == pytest.approx(history.history["loss"][0])  # a finite float
    seen.clear()
    assert set(trainer.evaluate(model, (X, Y), batch_size=16, verbose=0, return_dict=True)) == {"loss", "accuracy"}
    assert {d for d, _ in seen} == {dtype}
    predictions = trainer.predict(model, X, batch_size=16, verbose=0)
    assert predictions.dtype == torch.float32 and predictions.shape == (64, 2)


def test_sixteen_mixed_wraps_the_optimizer_once():
    trainer = Trainer(optimizer=optimizers.Adam(0.01), precision="16-mixed")
    assert isinstance(trainer.optimizer, optimizers.LossScaleOptimizer)
    assert isinstance(trainer.optimizer.inner_optimizer, optimizers.Adam)
    wrapped = optimizers.LossScaleOptimizer(optimizers.SGD(), initial_scale=8.0)
    assert Trainer(optimizer=wrapped, precision="16-mixed").optimizer is wrapped
    assert not isinstance(Trainer(optimizer="adam", precision="bf16-mixed").optimizer, optimizers.LossScaleOptimizer)


@pytest.mark.parametrize("precision", ["16", "bf16", "fp16", 16, True, None])
def test_a_bad_precision_names_the_choices(precision):
    with pytest.raises(ValueError, match="'32', 'bf16-mixed', '16-mixed'"):
        Trainer(precision=precision)


@pytest.mark.parametrize("precision", [32, "32", "32-true"])
def test_float32_spellings(precision):
    assert Trainer(precision=precision).precision == "32"


def test_accumulation_keeps_per_step_logs_and_applies_the_partial_window():
    logged = []
    from replicafit.trainer import LambdaCallback

    trainer = Trainer(optimizer=optimizers.SGD(0.1, gradient_accumulation_steps=3), loss="cross_entropy", seed=0)

    def record(batch, logs):
        logged.append((batch, int(trainer.optimizer.iterations)))

    cb = LambdaCallback(on_train_batch_end=record)
    trainer.fit(make_model(), (X, Y), batch_size=8, epochs=2, verbose=0, callbacks=[cb])
    # 8 steps per epoch: updates after steps 3 and 6, the partial window (7, 8) at the epoch's end
    assert [i for _, i in logged] == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 5, 5, 5]
    assert int(trainer.optimizer.iterations) == 6


# --- recipes ------------------------------------------------------------------------------------
def test_recipe_precision_key_is_checked():
    recipe = recipes.load("digits_mlp", overrides=["precision=bf16"])
    with pytest.raises(RecipeError, match="precision: expected one of 32, bf16-mixed, 16-mixed"):
        recipes.validate(recipe)
    recipe = recipes.load("digits_mlp", overrides=["optimizer.gradient_accumulation_steps=1"])
    with pytest.raises(RecipeError, match="gradient_accumulation_steps.*integer >= 2"):
        recipes.validate(recipe)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "overrides",
    [
        ["precision=bf16-mixed"],
        ["precision=16-mixed"],
        ["data.batch_size=16", "optimizer.gradient_accumulation_steps=4"],  # batch 64 in micro-batches of 16
    ],
    ids=["bf16_mixed", "16_mixed", "accumulation_4"],
)
def test_the_digits_recipe_reaches_95_percent(overrides):
    run = recipes.build(recipes.load("digits_mlp", overrides=overrides + ["fit.verbose=0"]))
    history = run.trainer.fit(run.model, run.train, callbacks=run.callbacks, **run.fit_kwargs)
    assert max(history.history["val_accuracy"]) >= 0.95, history.history["val_accuracy"]
    if "precision=16-mixed" in overrides:
        assert isinstance(run.trainer.optimizer, optimizers.LossScaleOptimizer)
    if "optimizer.gradient_accumulation_steps=4" in overrides:
        assert run.trainer.optimizer.gradient_accumulation_steps == 4
