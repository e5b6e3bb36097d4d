"""``TorchLRScheduler``: torch's own schedulers drive the learning rate exactly as in a plain torch loop
(per step or per epoch, ReduceLROnPlateau from the logs), under Mirrored(2), for our optimizers and
``from_torch``'s, through checkpoints and ``BackupAndRestore``, and in recipes."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from conftest import STRATEGY_IDS, InterruptAt, make_strategy
from torch.optim import lr_scheduler as L

from replicafit import optimizers, recipes
from replicafit.recipes import RecipeError
from replicafit.trainer import BackupAndRestore, Callback, TorchLRScheduler, Trainer

pytestmark = pytest.mark.timeout(120)

generator = torch.Generator().manual_seed(0)
X = torch.randn(120, 6, generator=generator)
Y = (X[:, 0] + X[:, 1] > 0).long()
EPOCHS, BATCH = 4, 16
STEPS = 6  # 96 training rows (validation_split=0.2) in batches of 16


def warm_up_then_cosine(optimizer):
    warm_up = L.LinearLR(optimizer, start_factor=0.1, total_iters=4)
    return L.SequentialLR(optimizer, [warm_up, L.CosineAnnealingLR(optimizer, T_max=20)], milestones=[4])


SCHEDULERS = {
    "one_cycle_step": (functools.partial(L.OneCycleLR, max_lr=0.3, total_steps=EPOCHS * STEPS), "step"),
    "cosine_epoch": (functools.partial(L.CosineAnnealingLR, T_max=EPOCHS), "epoch"),
    "cosine_step": (functools.partial(L.CosineAnnealingLR, T_max=EPOCHS * STEPS), "step"),
    "step_lr_epoch": (functools.partial(L.StepLR, step_size=1, gamma=0.5), "epoch"),
    "lambda_step": (lambda optimizer: L.LambdaLR(optimizer, lambda step: 1 / (1 + step)), "step"),
    "warm_up_chain_step": (warm_up_then_cosine, "step"),
    "plateau_epoch": (functools.partial(L.ReduceLROnPlateau, factor=0.5, patience=0, threshold=0.5), "epoch"),
}


class Recorder(Callback):
    """The learning rate (and SGD's momentum) each training step runs with."""

    def __init__(self):
        super().__init__()
        self.rates, self.momenta = [], []

    def on_train_batch_begin(self, batch, logs=None):
        optimizer = self.trainer.optimizer
        self.rates.append(optimizer.learning_rate)
        if hasattr(optimizer, "torch_kwargs"):  # from_torch: every copy's torch optimizer (built at the first step)
            groups = [g["momentum"] for o in optimizer._torch_optimizers for g in o.param_groups]
            self.momenta.append(groups or [optimizer.torch_kwargs["momentum"]])
        else:
            self.momenta.append(getattr(optimizer, "momentum", None) or getattr(optimizer, "beta_1", None))


def make_optimizer(kind):
    if kind == "from_torch":
        return optimizers.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
    return optimizers.SGD(0.1, momentum=0.9)


def fit(factory, interval, kind="ours", callbacks=(), strategy="mirrored2", epochs=EPOCHS, first=(), **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    trainer = Trainer(strategy=make_strategy(strategy), optimizer=make_optimizer(kind), seed=0)
    recorder = Recorder()
    scheduler = TorchLRScheduler(factory, interval=interval, **kwargs)
    history = trainer.fit(
        model,
        (X, Y),
        batch_size=BATCH,
        epochs=epochs,
        validation_split=0.2,
        verbose=0,
        shuffle=False,
        callbacks=[*first, scheduler, recorder, *callbacks],
    )
    return trainer, model, history.history, recorder


def plain_torch(factory, interval, val_losses=None, epochs=EPOCHS):
    """The learning rates (and momenta) of the same scheduler on a plain torch loop."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.1, momentum=0.9)
    scheduler = factory(optimizer)
    rates, momenta = [], []
    for epoch in range(epochs):
        for _ in range(STEPS):
            rates.append(optimizer.param_groups[0]["lr"])
            momenta.append(optimizer.param_groups[0]["momentum"])
            optimizer.step()
            if interval == "step":
                scheduler.step()
        if interval == "epoch":
            scheduler.step(val_losses[epoch]) if isinstance(scheduler, L.ReduceLROnPlateau) else scheduler.step()
    return rates, momenta


@pytest.mark.parametrize("kind", ["ours", "from_torch"])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_the_learning_rate_follows_torch_exactly(name, kind):
    factory, interval = SCHEDULERS[name]
    _, _, history, recorder = fit(factory, interval, kind)
    rates, momenta = plain_torch(factory, interval, history["val_loss"])
    assert recorder.rates == rates
    if kind == "ours":
        assert recorder.momenta == momenta  # OneCycleLR cycles the momentum too
    else:
        assert [m[0] for m in recorder.momenta] == momenta and all(len(set(m)) == 1 for m in recorder.momenta)
    if name == "plateau_epoch":
        assert len(set(rates)) > 1  # it did reduce
    # logged: the rate of each epoch's last step
    assert history["learning_rate"] == [rates[(e + 1) * STEPS - 1] for e in range(EPOCHS)]


# --- OneCycleLR on optimizers made without momentum: torch accepts them and turns momentum on -------------
ONE_CYCLE = functools.partial(L.OneCycleLR, max_lr=0.3, total_steps=2 * STEPS)
TORCH_COUNTERPARTS = {  # ours -> (the torch optimizer a plain loop uses, the hyper-parameter OneCycleLR cycles)
    "sgd": (lambda: optimizers.SGD(), lambda p: torch.optim.SGD(p, lr=0.01), "momentum"),
    "from_torch_sgd": (
        lambda: optimizers.from_torch(torch.optim.SGD, lr=0.01),
        lambda p: torch.optim.SGD(p, lr=0.01),
        "momentum",
    ),
    "rmsprop": (lambda: optimizers.RMSprop(), lambda p: torch.optim.RMSprop(p, lr=0.001), "momentum"),
    "adam": (lambda: optimizers.Adam(), lambda p: torch.optim.Adam(p, lr=0.001), "beta_1"),
}


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def one_cycle_fit(kind, strategy="mirrored2", callbacks=(), first=()):
    """Two epochs of OneCycleLR per step on ``kind`` made without momentum: the recorder, the model, the trainer."""
    model, recorder = small_model(), Recorder()
    trainer = Trainer(strategy=make_strategy(strategy), optimizer=TORCH_COUNTERPARTS[kind][0](), seed=0)
    scheduler = TorchLRScheduler(ONE_CYCLE, interval="step")
    trainer.fit(
        model,
        (X, Y),
        batch_size=BATCH,
        epochs=2,
        validation_split=0.2,
        verbose=0,
        shuffle=False,
        callbacks=[*first, scheduler, recorder, *callbacks],
    )
    return recorder, model, trainer


def one_cycle_torch_loop(kind, rule="torch"):
    """The same two epochs in a plain torch loop (``rule="keras"``: the update is Keras' SGD formula, driven
    by the rates and momenta torch's scheduler sets): the rates, the cycled values, the model."""
    model = small_model()
    optimizer = TORCH_COUNTERPARTS[kind][1](list(model.parameters()))
    scheduler = ONE_CYCLE(optimizer)
    buffers = [torch.zeros_like(p) for p in model.parameters()]
    rates, cycled = [], []
    for _ in range(2):
        for start in range(0, STEPS * BATCH, BATCH):
            group = optimizer.param_groups[0]
            rates.append(group["lr"])
            cycled.append(group["betas"][0] if "betas" in group else group["momentum"])
            loss = torch.nn.functional.cross_entropy(model(X[start : start + BATCH]), Y[start : start + BATCH])
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for p, g, m in zip(model.parameters(), grads, buffers):
                    if rule == "torch":
                        p.grad = g
                    else:  # m = momentum * m - lr * g; w += m
                        m.mul_(group["momentum"]).sub_(g, alpha=group["lr"])
                        p.add_(m)
            optimizer.step()  # with rule="keras" no parameter has a gradient: torch's order check only
            scheduler.step()
    return rates, cycled, model


def test_one_cycle_turns_momentum_on_in_sgd_made_without_it_as_torch_does():
    recorder, model, trainer = one_cycle_fit("sgd")
    rates, momenta, keras = one_cycle_torch_loop("sgd", rule="keras")
    assert recorder.rates == rates and recorder.momenta == momenta and momenta[0] == 0.95
    for ours, expected in zip(model.parameters(), keras.parameters()):
        torch.testing.assert_close(ours, expected)  # Keras' formula, with torch's rates and momenta
    assert all(set(slots) == {"momentum"} for slots in trainer.optimizer.state_dict()["slots"].values())


def test_one_cycle_on_from_torch_sgd_without_momentum_equals_the_torch_loop():
    recorder, model, _ = one_cycle_fit("from_torch_sgd")
    rates, momenta, plain = one_cycle_torch_loop("from_torch_sgd")
    assert recorder.rates == rates and [m[0] for m in recorder.momenta] == momenta
    for ours, expected in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(ours, expected)


@pytest.mark.parametrize("kind", ["rmsprop", "adam"])
def test_one_cycle_cycles_rmsprop_momentum_from_0_and_adam_beta_1(kind):
    recorder, _, trainer = one_cycle_fit(kind)
    rates, cycled, _ = one_cycle_torch_loop(kind)
    assert recorder.rates == rates and recorder.momenta == cycled and len(set(cycled)) > 1
    # RMSprop's momentum slots made when OneCycleLR set the momentum; Adam's first and second moments
    assert all(set(slots) == {"momentum", "velocity"} for slots in trainer.optimizer.state_dict()["slots"].values())


@pytest.mark.parametrize("strategy", STRATEGY_IDS)
def test_momentum_turned_on_by_the_scheduler_is_the_same_under_every_strategy(strategy):
    _, model, trainer = one_cycle_fit("sgd", strategy=strategy)
    _, reference, _ = one_cycle_fit("sgd", strategy="default")
    for ours, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(ours, expected)
    state = trainer.optimizer.state_dict()
    assert len(state["slots"]) == 4 and all(set(slots) == {"momentum"} for slots in state["slots"].values())
    assert all(slots["momentum"].abs().sum() > 0 for slots in state["slots"].values())


def test_a_resumed_one_cycle_run_on_sgd_without_momentum_continues_exactly(tmp_path):
    """The backup restores (and builds the optimizer) before the scheduler turns momentum on: the saved momentum
    slots are made then."""
    backup = tmp_path / "backup"
    recorder, model, _ = one_cycle_fit("sgd")
    with pytest.raises(KeyboardInterrupt):
        one_cycle_fit("sgd", first=[BackupAndRestore(backup)], callbacks=[InterruptAt(9)])
    resumed, resumed_model, _ = one_cycle_fit("sgd", first=[BackupAndRestore(backup)])
    assert resumed.rates == recorder.rates[STEPS:] and resumed.momenta == recorder.momenta[STEPS:]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def test_cycle_momentum_false_leaves_sgd_without_momentum():
    trainer = Trainer(optimizer=optimizers.SGD(), seed=0)
    scheduler = TorchLRScheduler(functools.partial(ONE_CYCLE, cycle_momentum=False), interval="step")
    trainer.fit(small_model(), (X, Y), batch_size=BATCH, epochs=1, verbose=0, callbacks=[scheduler])
    assert trainer.optimizer.momentum == 0 and all(not s for s in trainer.optimizer.state_dict()["slots"].values())


def test_with_gradient_accumulation_the_step_interval_counts_updates():
    torch.manual_seed(0)
    optimizer = optimizers.SGD(0.1, momentum=0.9, gradient_accumulation_steps=4)  # 6 steps: windows of 4 and 2
    trainer = Trainer(strategy=make_strategy("mirrored2"), optimizer=optimizer, seed=0)
    recorder = Recorder()
    scheduler = TorchLRScheduler(functools.partial(L.StepLR, step_size=1, gamma=0.5), interval="step")
    model = torch.nn.Linear(6, 2)
    trainer.fit(model, (X[:96], Y[:96]), batch_size=BATCH, epochs=2, verbose=0, callbacks=[scheduler, recorder])
    assert recorder.rates == [0.1] * 4 + [0.05] * 2 + [0.025] * 4 + [0.0125] * 2


class RatesAtBatchEnd(Callback):
    """The learning rate each step ran with, read at the step's end (listed before the scheduler): no
    ``on_train_batch_begin`` of its own, so only the scheduler asks the trainer for that hook."""

    def __init__(self):
        super().__init__()
        self.rates = []

    def on_train_batch_end(self, batch, logs=None):
        self.rates.append(self.trainer.optimizer.learning_rate)


def test_with_gradient_accumulation_the_step_interval_counts_updates_with_no_other_callback():
    """Regression: the scheduler's own batch-begin hook notes the update count; the trainer calls that hook
    only where a callback asks for it, and the scheduler did not ask, so it stepped one update early."""
    optimizer = optimizers.SGD(0.1, gradient_accumulation_steps=4)  # 6 steps an epoch: windows of 4 and 2
    trainer = Trainer(strategy=make_strategy("mirrored2"), optimizer=optimizer, seed=0)
    rates = RatesAtBatchEnd()
    scheduler = TorchLRScheduler(functools.partial(L.StepLR, step_size=1, gamma=0.5), interval="step")
    trainer.fit(
        torch.nn.Linear(6, 2), (X[:96], Y[:96]), batch_size=BATCH, epochs=2, verbose=0, callbacks=[rates, scheduler]
    )
    assert rates.rates == [0.1] * 4 + [0.05] * 2 + [0.025] * 4 + [0.0125] * 2
    assert scheduler.scheduler.last_epoch == 4  # one step per update


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_resumed_run_continues_the_schedule_exactly(tmp_path, name):
    factory, interval = SCHEDULERS[name]
    backup = tmp_path / "backup"
    _, model, history, recorder = fit(factory, interval)
    with pytest.raises(KeyboardInterrupt):  # in the third epoch, after a mid-epoch backup
        fit(factory, interval, callbacks=[BackupAndRestore(backup, save_freq=4), InterruptAt(15)])
    _, resumed_model, resumed_history, resumed = fit(
        factory, interval, callbacks=[BackupAndRestore(backup, save_freq=4)]
    )
    assert resumed.rates == recorder.rates[12:] and resumed.momenta == recorder.momenta[12:]
    assert resumed_history == history
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


@pytest.mark.parametrize("name", ["one_cycle_step", "step_lr_epoch"])
@pytest.mark.parametrize("save_freq", [4, "epoch"])
def test_a_backup_listed_before_the_scheduler_saves_after_its_step(tmp_path, name, save_freq):
    """A backup is written once every callback has acted on the step (or epoch): the scheduler has stepped,
    so the resumed run does not replay a learning rate, whichever callback comes first in the list."""
    factory, interval = SCHEDULERS[name]
    backup = tmp_path / "backup"
    _, model, history, recorder = fit(factory, interval)
    with pytest.raises(KeyboardInterrupt):
        fit(factory, interval, first=[BackupAndRestore(backup, save_freq=save_freq)], callbacks=[InterruptAt(15)])
    _, resumed_model, resumed_history, resumed = fit(factory, interval, first=[BackupAndRestore(backup, save_freq)])
    assert resumed.rates == recorder.rates[-len(resumed.rates) :]
    assert resumed_history == history
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed_model.parameters()))


def test_a_checkpoint_keeps_the_schedule(tmp_path):
    factory, interval = SCHEDULERS["step_lr_epoch"]
    _, _, _, recorder = fit(factory, interval)
    trainer, model, _, _ = fit(factory, interval, epochs=2)
    path = trainer.save_checkpoint(tmp_path / "ckpt.pt")
    assert torch.load(path, weights_only=True)["callbacks"]["TorchLRScheduler_0"]["scheduler"]["last_epoch"] == 2
    again = Trainer(strategy=make_strategy("mirrored2"), optimizer=make_optimizer("ours"), seed=0)
    again.load_checkpoint(path, model=model)
    later = Recorder()
    again.fit(
        model,
        (X, Y),
        batch_size=BATCH,
        epochs=EPOCHS,
        initial_epoch=2,
        validation_split=0.2,
        verbose=0,
        shuffle=False,
        callbacks=[TorchLRScheduler(factory, interval=interval), later],
    )
    assert later.rates == recorder.rates[2 * STEPS :]


def test_a_plateau_monitor_missing_from_the_logs_warns_once():
    factory = functools.partial(L.ReduceLROnPlateau, patience=0)
    with pytest.warns(UserWarning, match="'val_acc', which is not in the logs") as caught:
        _, _, _, recorder = fit(factory, "epoch", monitor="val_acc")
    assert len([w for w in caught if "val_acc" in str(w.message)]) == 1
    assert set(recorder.rates) == {0.1}


def test_only_a_per_step_plateau_reads_the_logs_every_step():
    def wants(callback):
        return callback.wants_logs("on_train_batch_end")

    assert not wants(TorchLRScheduler(functools.partial(L.OneCycleLR, max_lr=0.1, total_steps=10), interval="step"))
    assert wants(TorchLRScheduler("ReduceLROnPlateau", interval="step", monitor="loss"))
    assert not wants(TorchLRScheduler("ReduceLROnPlateau", interval="epoch"))


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        ((lambda o: None,), {"interval": "batch"}, ValueError, "'step' or 'epoch'"),
        (("OneCycle",), {}, ValueError, "not a scheduler of torch.optim.lr_scheduler"),
        ((lambda o: None,), {"max_lr": 0.1}, TypeError, "functools.partial"),
        ((3,), {}, TypeError, "callable"),
    ],
)
def test_bad_arguments_say_what_to_do(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        TorchLRScheduler(*args, **kwargs)


def test_a_factory_that_returns_no_scheduler_and_a_scheduled_optimizer_are_refused():
    with pytest.raises(TypeError, match="must return a torch.optim.lr_scheduler"):
        fit(lambda optimizer: optimizer, "epoch")
    trainer = Trainer(optimizer=optimizers.SGD(optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)))
    with pytest.raises(ValueError, match="learning_rate is a schedule already"):
        trainer.fit(
            torch.nn.Linear(6, 2), (X, Y), batch_size=16, verbose=0, callbacks=[TorchLRScheduler("StepLR", step_size=1)]
        )


def test_in_a_recipe_one_cycle_fills_in_the_run_length():
    entry = "{type: torch_lr_scheduler, factory: OneCycleLR, interval: step, max_lr: 0.01}"
    recipe = recipes.load("digits_mlp", overrides=[f"callbacks=[{entry}]", "fit.epochs=2", "fit.verbose=0"])
    run = recipes.build(recipe)
    recorder = Recorder()
    history = run.trainer.fit(run.model, run.train, callbacks=[*run.callbacks, recorder], **run.fit_kwargs)
    steps = len(recorder.rates)
    assert run.callbacks[0].scheduler.total_steps == steps == 2 * math.ceil(1437 / 64)
    assert recorder.rates[0] == pytest.approx(0.01 / 25) and max(recorder.rates) == pytest.approx(0.01, rel=1e-3)
    assert len(history.history["learning_rate"]) == 2


def test_recipe_scheduler_arguments_are_checked():
    recipe = recipes.load("digits_mlp", overrides=["callbacks=[{type: torch_lr_scheduler, factory: OneCyc}]"])
    with pytest.raises(RecipeError, match="not a scheduler of torch.optim.lr_scheduler"):
        recipes.build(recipe)


def test_one_cycle_cycles_beta_1_of_an_optimizer_of_ones_own():
    """Regression: an optimizer of one's own with ``beta_1``/``beta_2`` (the docstring's Lion) has them cycled, as
    torch's Adam has its betas (the scheduler asks the optimizer's ``torch_hyperparameters``)."""
    from conftest import Lion

    seen = []

    class Betas(Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(self.trainer.optimizer.beta_1)

    trainer = Trainer(optimizer=Lion(1e-3), loss="cross_entropy", metrics=[], seed=0)
    schedule = TorchLRScheduler(functools.partial(L.OneCycleLR, max_lr=0.1, total_steps=EPOCHS * STEPS), "step")
    trainer.fit(torch.nn.Linear(6, 2), (X[:96], Y[:96]), batch_size=BATCH, epochs=EPOCHS, verbose=0,
                callbacks=[schedule, Betas()])  # fmt: skip
    assert len(set(seen)) > 1 and max(seen) == pytest.approx(0.95) and min(seen) < 0.9
