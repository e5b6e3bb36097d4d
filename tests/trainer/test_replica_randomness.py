"""``Trainer(seed=...)`` makes runs with dropout reproducible under every strategy: each replica draws from
its own stream (strategies/rng.py), kept in checkpoints and backups."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, Callback, Trainer, checkpoint

STRATEGIES = {
    "default": lambda: None,
    "mirrored2": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1"]),
    "mirrored3": lambda: ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),  # 32 rows: 11/11/10
    "central_storage2": lambda: ds.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "one_device": lambda: ds.OneDeviceStrategy("cpu:0"),
}


def _data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(100, 6, generator=generator)  # 100 rows in batches of 32: a partial last batch of 4
    y = (x[:, 0] - x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()
    return x, y


def _model(init_seed=0):
    torch.manual_seed(init_seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.4), torch.nn.Linear(16, 3), torch.nn.Dropout(0.2)
    )


def _fit(strategy, seed=3, init_seed=0, callbacks=(), epochs=3, model=None, trainer=None):
    model = model if model is not None else _model(init_seed)
    trainer = trainer or Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1, momentum=0.9), seed=seed)
    history = trainer.fit(model, _data(), batch_size=32, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return {"history": history.history, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _same(a, b) -> bool:
    return a["history"] == b["history"] and all(torch.equal(a["weights"][k], v) for k, v in b["weights"].items())


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_two_runs_with_one_seed_are_bit_identical_with_dropout(name):
    first = _fit(STRATEGIES[name]())
    # torch's generator left elsewhere in between (a user drawing, other tests): the seed decides alone
    torch.rand(17)
    second = _fit(STRATEGIES[name]())
    assert _same(first, second)
    other_seed = _fit(STRATEGIES[name](), seed=4)  # the masks matter: another seed trains otherwise
    assert other_seed["history"]["loss"] != first["history"]["loss"]


def test_replicas_on_threads_train_as_replicas_taking_turns(replica_threads):
    on_threads = _fit(STRATEGIES["mirrored3"]())
    ds.set_replica_execution("auto")
    assert _same(_fit(STRATEGIES["mirrored3"]()), on_threads)


def test_mirrored_and_central_storage_draw_the_same_masks():
    # the same replicas (global ids 0 and 1) with the same seed: one training, whatever holds the variables
    assert _same(_fit(STRATEGIES["mirrored2"]()), _fit(STRATEGIES["central_storage2"]()))


class _Interrupt(Callback):
    def __init__(self, at):
        super().__init__()
        self.at, self.seen = at, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("name", ["mirrored3", "default"])
def test_an_interrupted_run_resumed_from_its_backup_ends_where_the_straight_run_ends(name, tmp_path):
    straight = _fit(STRATEGIES[name](), epochs=3)
    backup = BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    with pytest.raises(KeyboardInterrupt):
        _fit(STRATEGIES[name](), epochs=3, callbacks=[backup, _Interrupt(7)])  # epoch 2, batch 3; saved after 6
    # the new process would have other generator states: a different init seed and draws in between
    torch.rand(5)
    resumed = _fit(STRATEGIES[name](), epochs=3, init_seed=99, callbacks=[BackupAndRestore(str(tmp_path / "backup"))])
    assert _same(resumed, straight)


def test_checkpoints_hold_every_replicas_stream_and_a_seedless_fit_keys_from_their_seed(tmp_path):
    strategy = STRATEGIES["mirrored2"]()
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), seed=3)
    model = _model()
    _fit(strategy, trainer=trainer, model=model, epochs=1)
    path = trainer.save_checkpoint(tmp_path / "ck.pt")
    state = torch.load(path, weights_only=True)
    assert state["replica_rng"]["seed"] == 3 and len(state["replica_rng"]["cpu"]) == 2
    assert not torch.equal(state["replica_rng"]["cpu"][0], state["replica_rng"]["cpu"][1])
    trainer.seed = None  # a seedless fit after load_checkpoint keys the streams from the checkpoint's seed
    trainer.load_checkpoint(path)
    random.seed(0)  # (the data seed a seedless fit draws)
    continued = _fit(strategy, trainer=trainer, model=model, epochs=1)

    again = Trainer(strategy=STRATEGIES["mirrored2"](), optimizer=optimizers.SGD(0.1), seed=None)
    model_again = _model(init_seed=5)
    again.load_checkpoint(path, model=model_again)
    torch.rand(3)
    random.seed(0)
    assert _same(_fit(again.strategy, trainer=again, model=model_again, epochs=1), continued)
    # without the checkpoint's streams (seeded from the data seed) the same fit trains otherwise
    other = Trainer(strategy=STRATEGIES["mirrored2"](), optimizer=optimizers.SGD(0.1), seed=None)
    model_other = _model()
    other.load_checkpoint(path, model=model_other)
    other._training_state._replica_rng_loaded = False
    random.seed(0)
    assert not _same(_fit(other.strategy, trainer=other, model=model_other, epochs=1), continued)


def test_a_checkpoint_of_two_replicas_loads_under_three_and_no_replica_replays_the_first_masks(tmp_path):
    """Replicas 0 and 1 go on with their saved streams; replica 2, new, is seeded from the position."""
    trainer = Trainer(strategy=STRATEGIES["mirrored2"](), optimizer=optimizers.SGD(0.1), seed=3)
    model = _model()
    _fit(trainer.strategy, trainer=trainer, model=model, epochs=1)
    path = trainer.save_checkpoint(tmp_path / "ck.pt")
    three = Trainer(strategy=STRATEGIES["mirrored3"](), optimizer=optimizers.SGD(0.1))
    three.load_checkpoint(path, model=_model())
    streams = three.strategy.extended._replica_streams
    state = streams.state_dict()
    assert state["seed"] == 3 and len(state["cpu"]) == 3
    fresh = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]).extended._replica_streams
    fresh.seed(3)
    saved = trainer.strategy.extended._replica_streams.state_dict()
    assert torch.equal(state["cpu"][0], saved["cpu"][0]) and torch.equal(state["cpu"][1], saved["cpu"][1])
    for replica in range(3):  # not the run's first masks again
        assert not torch.equal(state["cpu"][replica], fresh.state_dict()["cpu"][replica])


def test_a_damaged_stream_entry_is_a_clear_checkpoint_error(tmp_path):
    trainer = Trainer(strategy=STRATEGIES["mirrored2"](), optimizer=optimizers.SGD(0.1), seed=3)
    model = _model()
    _fit(trainer.strategy, trainer=trainer, model=model, epochs=1)
    path = trainer.save_checkpoint(tmp_path / "ck.pt")
    state = torch.load(path, weights_only=True)
    state["replica_rng"]["cpu"][1] = torch.zeros(3, dtype=torch.uint8)
    torch.save(state, tmp_path / "bad.pt")
    with pytest.raises(checkpoint.CheckpointError, match=r"replica_rng\['cpu'\]\[1\] must be torch's CPU random"):
        trainer.load_checkpoint(tmp_path / "bad.pt")


def test_a_seedless_fit_agrees_its_replica_seed_with_its_data_seed():
    trainer = Trainer(strategy=STRATEGIES["mirrored2"](), optimizer=optimizers.SGD(0.1))
    _fit(trainer.strategy, trainer=trainer, model=_model(), epochs=1)
    assert trainer.strategy.extended._replica_streams.base_seed == trainer._training_state.data_seed


def test_the_digits_recipe_with_dropout_is_reproducible():
    from replicafit import recipes

    results = []
    for _ in range(2):
        recipe = recipes.load("digits_mlp", overrides=["model.dropout=0.3", "fit.epochs=2"])
        run = recipes.build(recipe, recipes.validate(recipe))
        history = run.trainer.fit(run.model, run.train, **{**run.fit_kwargs, "verbose": 0})
        weights = [p.detach().clone() for p in run.model.parameters()]
        results.append((history.history, weights))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert np.isfinite(results[0][0]["val_accuracy"][-1])


# --- keyed streams: a fit draws by (seed, global replica id, epoch, step), whatever a backup holds -------------------


class _Noise(torch.nn.Module):
    """Draws in training and in evaluation alike (a random augmentation kept at test time)."""

    def forward(self, x):
        return x + 0.1 * torch.rand_like(x)


class _StopInValidation(Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_test_begin(self, logs=None):
        if self.trainer._training_state.epoch == self.epoch:  # (private: where the fit stands)
            raise KeyboardInterrupt


def _noisy_fit(callbacks=(), init_seed=0):
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), _Noise(), torch.nn.ReLU(), torch.nn.Dropout(0.4), torch.nn.Linear(16, 3)
    )
    trainer = Trainer(strategy=STRATEGIES["mirrored2"](), optimizer=optimizers.SGD(0.1, momentum=0.9), seed=3)
    x, y = _data()
    history = trainer.fit(
        model, (x, y), batch_size=32, epochs=3, validation_data=(x[:40], y[:40]), verbose=0, callbacks=list(callbacks)
    )
    return {"history": history.history, "weights": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("where", ["mid_epoch", "in_validation"])
def test_a_backup_without_the_replicas_streams_resumes_bit_identical(where, tmp_path):
    """fit keys every replica's stream before each training step and before validation (``ReplicaStreams.key``):
    a backup that lacks the replicas' streams, as a survivor's after a peer's failure lacks the dead worker's,
    resumes to the straight run bit for bit, validation included. Before: the lost replicas started fresh
    streams, and the resumed run drew other dropout masks."""
    straight = _noisy_fit()
    if where == "mid_epoch":  # saved after 6 steps (epoch 1 after step 2), interrupted after 7
        interrupted = [BackupAndRestore(str(tmp_path / "backup"), save_freq=2), _Interrupt(7)]
    else:  # saved after the epoch's 4 steps, interrupted in its validation: the resumed fit validates first
        interrupted = [BackupAndRestore(str(tmp_path / "backup"), save_freq=4), _StopInValidation(1)]
    with pytest.raises(KeyboardInterrupt):
        _noisy_fit(interrupted)
    path = tmp_path / "backup" / "backup.pt"
    state = torch.load(path, weights_only=True)
    assert (state["epoch"], state["step"]) == ((1, 2) if where == "mid_epoch" else (1, 4))
    state["replica_rng"]["cpu"][1] = None  # as a survivor writes the streams it does not hold
    torch.save(state, path)
    torch.rand(5)  # another process: other generator states
    resumed = _noisy_fit([BackupAndRestore(str(tmp_path / "backup"))], init_seed=99)
    assert _same(resumed, straight)


class _FirstDraws(torch.nn.Module):
    """Keeps what the replicas draw in the fit's first step."""

    def __init__(self):
        super().__init__()
        self.draws = []

    def forward(self, x):
        if len(self.draws) < 2:
            self.draws.append(torch.rand(4))
        return x


def test_a_seedless_fit_after_load_checkpoint_repeats_none_of_the_savers_draws(tmp_path):
    """fit keys the streams per step from their seed; after load_checkpoint a seedless fit keys them from the
    checkpoint's seed and its own data seed, so its first step does not draw what the saver's first step drew."""
    probe = _FirstDraws()
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), probe)
    trainer = Trainer(strategy=STRATEGIES["mirrored2"](), optimizer=optimizers.SGD(0.1), seed=3)
    _fit(trainer.strategy, trainer=trainer, model=model, epochs=1)
    first = list(probe.draws)
    path = trainer.save_checkpoint(tmp_path / "ck.pt")
    trainer.seed = None
    trainer.load_checkpoint(path)
    probe.draws.clear()
    _fit(trainer.strategy, trainer=trainer, model=model, epochs=1)
    assert len(first) == len(probe.draws) == 2
    assert not any(torch.equal(a, b) for a in first for b in probe.draws)
