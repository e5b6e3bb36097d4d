"""torchmetrics metrics in ``Trainer(metrics=...)``: every replica updates its own copy, and the logs combine the
copies by each state's own reduction, so they equal one device's ``compute()`` on the same data (``cat``
states in the input's order) under every strategy, across workers, in backups and in recipes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch_metrics_scenarios as scenarios
from conftest import InterruptAt, make_strategy
from multiworker_harness import results, run_workers
from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score
from torchmetrics.regression import MeanSquaredError

import replicafit.strategies as ds
from replicafit import cli, optimizers
from replicafit.trainer import Trainer, callbacks
from replicafit.trainer.torch_metrics import TorchMetric

STRATEGIES = ["default", "mirrored3", "central_storage2", "multi_worker1x2"]


def close_logs(got: dict, expected: dict, atol=1e-6, what=""):
    assert sorted(got) == sorted(expected), what
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=atol), f"{what}: {key}"


def one_device_values(model, x, y) -> dict:
    """torchmetrics on one device, on the whole data at once (the oracle)."""
    with torch.no_grad():
        logits = model(x)
    values = {}
    for metric in scenarios.classification_metrics():
        metric.update(logits, y)
        values[TorchMetric(metric).name] = float(metric.compute())
    return values


@pytest.fixture(scope="module")
def reference():
    return {
        "classification": scenarios.classification_run(ds.get_strategy()),
        "regression": scenarios.regression_run(ds.get_strategy()),
    }


def test_fit_logs_equal_a_hand_loop_with_torchmetrics_on_one_device(reference):
    """The oracle: a plain torch loop (SGD, the mean loss) updating torchmetrics with each step's predictions."""
    (x, y), (vx, vy) = scenarios.classification_data()
    model = scenarios.classifier()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        train_metrics = scenarios.classification_metrics()
        for start in range(0, 115, 32):
            logits = model(x[start : start + 32])
            for metric in train_metrics:
                metric.update(logits.detach(), y[start : start + 32])
            sgd.zero_grad()
            torch.nn.functional.cross_entropy(logits, y[start : start + 32]).backward()
            sgd.step()
        history = reference["classification"]["history"]
        for metric in train_metrics:
            name = TorchMetric(metric).name
            assert history[name][epoch] == pytest.approx(float(metric.compute()), abs=1e-6), name
        for name, value in one_device_values(model, vx, vy).items():
            assert history[f"val_{name}"][epoch] == pytest.approx(value, abs=1e-6), name
    close_logs(
        {k: v for k, v in reference["classification"]["evaluate"].items() if k != "loss"},
        one_device_values(model, vx, vy),
    )


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_every_strategy_logs_one_devices_values(strategy_name, reference):
    """Mirrored over 3 replicas: the last batches (19 training rows, 5 validation rows) are uneven."""
    got = scenarios.classification_run(make_strategy(strategy_name))
    expected = reference["classification"]
    for key, values in expected["history"].items():
        assert got["history"][key] == pytest.approx(values, abs=1e-6), key
    close_logs(got["evaluate"], expected["evaluate"])
    regression = scenarios.regression_run(make_strategy(strategy_name))
    for key, values in reference["regression"]["history"].items():
        assert regression["history"][key] == pytest.approx(values, abs=1e-6), key
    close_logs(regression["evaluate"], reference["regression"]["evaluate"], atol=1e-4)  # OrderedSum ~ 1e4


def test_cat_states_are_combined_in_the_inputs_order():
    """OrderedSum weighs each target by its position: only the input's order gives sum(i * (i + 1))."""
    expected = float(sum((i / 100) * (i + 1) for i in range(115)))
    for name in ["default", "mirrored3", "central_storage2"]:
        result = scenarios.regression_run(make_strategy(name))
        assert result["evaluate"]["ordered_sum"] == pytest.approx(expected, rel=1e-6), name
        assert result["history"]["ordered_sum"][0] == pytest.approx(expected, rel=1e-6), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["multi_worker_mirrored", "fully_sharded"])
def test_two_workers_log_one_devices_values(kind, reference):
    """Two workers (the last training batch of 19 rows: 10 and 9): the states are combined across them when the
    logs are read, the cat states in the input's order; sharded parameters alike."""
    outcomes = results(run_workers(scenarios.__file__, "workers", 2, timeout=100, kwargs={"kind": kind}))
    for worker, got in enumerate(outcomes):
        for kind in ("classification", "regression"):
            for key, values in reference[kind]["history"].items():
                assert got[kind]["history"][key] == pytest.approx(values, abs=1e-6), (worker, kind, key)
        close_logs(got["classification"]["evaluate"], reference["classification"]["evaluate"], what=str(worker))
        close_logs(got["regression"]["evaluate"], reference["regression"]["evaluate"], atol=1e-4, what=str(worker))


def test_a_backup_mid_epoch_resumes_the_metric_states(tmp_path, reference):
    """Interrupted at the second epoch's second step, after a backup at every step: the resumed epoch's logs
    (F1's counts and AUROC's concatenated scores, saved mid-epoch) equal the uninterrupted run's."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    backup = callbacks.BackupAndRestore(str(tmp_path), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        scenarios.classification_run(strategy, callbacks=[backup, InterruptAt(5)])
    resumed = scenarios.classification_run(
        ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]), callbacks=[callbacks.BackupAndRestore(str(tmp_path))]
    )
    for key, values in reference["classification"]["history"].items():
        assert resumed["history"][key][-1] == pytest.approx(values[-1], abs=1e-6), key


def test_a_backup_resumes_on_another_replica_count(tmp_path, reference):
    backup = callbacks.BackupAndRestore(str(tmp_path), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        scenarios.classification_run(ds.MirroredStrategy(["cpu:0", "cpu:1"]), callbacks=[backup, InterruptAt(6)])
    resumed = scenarios.classification_run(
        ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]), callbacks=[callbacks.BackupAndRestore(str(tmp_path))]
    )
    for key, values in reference["classification"]["history"].items():
        assert resumed["history"][key][-1] == pytest.approx(values[-1], abs=1e-6), key


def test_the_epoch_starts_each_metric_afresh_and_validation_leaves_training_alone(reference):
    history = reference["classification"]["history"]
    assert history["multiclass_f1_score"][0] != history["multiclass_f1_score"][1]
    # validation ran between the epochs: the training logs of epoch 1 equal a fit that validates never
    plain = scenarios.classification_data()[0]
    model = scenarios.classifier()
    trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", metrics=scenarios.classification_metrics())
    alone = trainer.fit(model, plain, epochs=2, batch_size=32, shuffle=False, verbose=0).history
    assert alone["multiclass_auroc"] == pytest.approx(history["multiclass_auroc"], abs=1e-7)


def test_zero_weights_leave_rows_out_and_other_weights_are_refused():
    metric = TorchMetric(MulticlassF1Score(num_classes=3))
    metric.build(ds.get_strategy())
    logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0]])
    metric.update_state(torch.tensor([0, 1, 0]), logits, sample_weight=torch.tensor([1.0, 1.0, 0.0]))
    assert float(metric.result()) == pytest.approx(1.0)  # the wrong third row was left out
    with pytest.raises(ValueError, match="counts each example once.*0 \\(left out\\) or 1"):
        metric.update_state(torch.tensor([0, 1, 2]), logits, sample_weight=torch.tensor([0.5, 1.0, 1.0]))


def test_a_metric_computing_several_values_is_refused_with_the_fix():
    trainer = Trainer(loss="cross_entropy", metrics=[MulticlassF1Score(num_classes=3, average=None)])
    (x, y), _ = scenarios.classification_data()
    with pytest.raises(ValueError, match=r"computed \(3,\), but logs hold numbers.*average='macro'"):
        trainer.fit(scenarios.classifier(), (x, y), batch_size=32, verbose=0)


def test_a_failing_update_names_the_metric_and_the_shapes():
    trainer = Trainer(loss="mse", metrics=[MeanSquaredError()])
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    model = torch.nn.Linear(4, 2)  # two outputs against one target per row
    with pytest.raises(Exception, match=r"mean_squared_error.*MeanSquaredError.update\(preds, target\).*\(8, 2\)"):
        trainer.fit(model, (x, y), batch_size=8, verbose=0)


def test_the_given_metric_is_a_template_and_a_name_can_be_given():
    template = MulticlassAUROC(num_classes=3)
    trainer = Trainer(loss="cross_entropy", metrics=[template, TorchMetric(MulticlassF1Score(num_classes=3), "f1")])
    (x, y), _ = scenarios.classification_data()
    history = trainer.fit(scenarios.classifier(), (x, y), batch_size=32, verbose=0)
    assert set(history.history) == {"loss", "multiclass_auroc", "f1"}
    assert template._update_count == 0  # never updated itself
    with pytest.raises(TypeError, match="TorchMetric wraps a torchmetrics Metric"):
        TorchMetric("accuracy")


def test_too_old_a_torchmetrics_is_a_clear_error(monkeypatch):
    import torchmetrics

    monkeypatch.setattr(torchmetrics, "__version__", "0.11.4")
    with pytest.raises(ImportError, match=r"torchmetrics 0.11.4 is too old.*replicafit\[torchmetrics\]"):
        TorchMetric(MulticlassF1Score(num_classes=3))


def test_torchmetrics_stays_optional():
    """Fitting with the trainer's own metrics never imports torchmetrics."""
    code = textwrap.dedent(
        """
        import sys, torch
        from replicafit.trainer import Trainer
        Trainer(loss="mse", metrics=["mae"]).fit(torch.nn.Linear(2, 1), (torch.ones(4, 2), torch.ones(4, 1)),
                                                 batch_size=2, verbose=0)
        assert "torchmetrics" not in sys.modules, "torchmetrics was imported"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_recipe_names_a_torchmetrics_metric_with_its_arguments(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(
            """
            seed: 0
            strategy: {type: mirrored, devices: ["cpu:0", "cpu:1"]}
            data: {type: digits, validation_split: 0.2, batch_size: 64}
            model: {type: mlp, hidden: [16]}
            optimizer: {type: adam}
            loss: cross_entropy
            metrics:
              - {type: "torchmetrics.classification:MulticlassF1Score", num_classes: 10}
            fit: {epochs: 1, verbose: 0}
            """
        )
    )
    assert cli.main(["validate", str(recipe)]) == 0
    assert cli.main(["fit", str(recipe), "--run-dir", str(tmp_path / "run")]) == 0
    header = (tmp_path / "run" / "history.csv").read_text().splitlines()[0].split(",")
    assert "multiclass_f1_score" in header and "val_multiclass_f1_score" in header


@pytest.mark.timeout(120)
def test_sum_states_ride_the_logs_reduction_with_no_collective_of_their_own():
    """Sum states are SyncOnRead variables, reduced with the trainer's own accumulators: with the logs read at
    every step across two workers, F1 adds one all-reduce per read (its int64 counts: one buffer per dtype,
    started with the float32 one) and nothing else, and three such metrics add no more than one."""
    for worker, counts in enumerate(results(run_workers(scenarios.__file__, "collectives_per_read", 2, timeout=100))):
        accuracy, f1, three, reads = counts["accuracy"], counts["f1"], counts["three"], counts["reads"]
        assert three == f1, worker
        assert {k: v for k, v in f1.items() if k != "all_reduce"} == {
            k: v for k, v in accuracy.items() if k != "all_reduce"
        }, worker
        assert 0 < f1["all_reduce"] - accuracy["all_reduce"] <= reads + 1, (worker, f1, accuracy, reads)


def test_a_metric_collection_gives_a_metric_per_member_with_its_name(reference):
    from torchmetrics import MetricCollection

    (x, y), validation = scenarios.classification_data()
    collection = MetricCollection(scenarios.classification_metrics())
    prefixed = MetricCollection({"f1": MulticlassF1Score(num_classes=3)}, prefix="my_")
    trainer = Trainer(optimizer=optimizers.SGD(0.1), loss="cross_entropy", metrics=[collection, prefixed])
    history = trainer.fit(
        scenarios.classifier(), (x, y), epochs=2, batch_size=32, validation_data=validation, shuffle=False, verbose=0
    ).history
    expected = reference["classification"]["history"]
    for key in ("multiclass_f1_score", "multiclass_auroc", "val_multiclass_auroc"):
        assert history[key] == pytest.approx(expected[key], abs=1e-6), key
    assert history["my_f1"] == pytest.approx(expected["multiclass_f1_score"], abs=1e-6)


def test_each_output_of_a_model_with_several_gets_its_own_copy():
    """A torchmetrics metric, or a TorchMetric, given once measures every output on its own."""

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

        def forward(self, x):
            return {"a": self.a(x), "b": self.b(x)}

    x = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
    ya, yb = torch.randint(0, 3, (20,)), torch.randint(0, 3, (20,))
    model = TwoHeads()
    trainer = Trainer(
        strategy=ds.MirroredStrategy(["cpu:0", "cpu:1"]),
        loss="cross_entropy",
        metrics=[MulticlassAUROC(num_classes=3), TorchMetric(MulticlassF1Score(num_classes=3), name="f1")],
    )
    logs = trainer.evaluate(model, (x, {"a": ya, "b": yb}), batch_size=8, verbose=0, return_dict=True)
    with torch.no_grad():
        outputs = model(x)
    for head, labels in (("a", ya), ("b", yb)):
        auroc, f1 = MulticlassAUROC(num_classes=3), MulticlassF1Score(num_classes=3)
        auroc.update(outputs[head], labels)
        f1.update(outputs[head], labels)
        assert logs[f"{head}_multiclass_auroc"] == pytest.approx(float(auroc.compute()), abs=1e-6)
        assert logs[f"{head}_f1"] == pytest.approx(float(f1.compute()), abs=1e-6)


@pytest.mark.timeout(150)
def test_a_backup_resumes_across_workers_counting_the_restored_states_once(tmp_path):
    """The combined states restored on every worker were counted once per worker (a cat-state count of 104
    rows for 64); on 2 workers, then on 2 workers of 2 replicas each, the resumed epoch equals the
    uninterrupted one."""
    expected = scenarios.resumed_run(ds.get_strategy())
    assert expected["row_count"] == [64.0]
    kwargs = {"backup_dir": str(tmp_path / "same")}
    for worker, got in enumerate(
        results(run_workers(scenarios.__file__, "interrupted_then_resumed", 2, timeout=120, kwargs=kwargs))
    ):
        close_logs({k: v[0] for k, v in got.items()}, {k: v[0] for k, v in expected.items()}, what=str(worker))
    kwargs = {"backup_dir": str(tmp_path / "other")}
    results(run_workers(scenarios.__file__, "interrupted_then_resumed", 2, timeout=120, kwargs=kwargs))
    kwargs["local_devices"] = ["cpu:0", "cpu:1"]
    for worker, got in enumerate(
        results(run_workers(scenarios.__file__, "interrupted_then_resumed", 2, timeout=120, kwargs=kwargs))
    ):
        close_logs({k: v[0] for k, v in got.items()}, {k: v[0] for k, v in expected.items()}, what=str(worker))


def pearson_run(strategy, callbacks=(), epochs=2):
    from torchmetrics.regression import PearsonCorrCoef

    torch.manual_seed(0)
    x = torch.randn(48, 3)
    y = x[:, :1] * 2 + torch.randn(48, 1)
    torch.manual_seed(1)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.05), loss="mse", metrics=[PearsonCorrCoef()])
    return trainer.fit(
        torch.nn.Linear(3, 1),
        (x, y),
        batch_size=8,
        epochs=epochs,
        validation_split=0.25,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    ).history


def test_unreduced_states_survive_validation_backups_and_another_replica_count(tmp_path):
    """PearsonCorrCoef's states have no reduction (torchmetrics stacks them): restoring them put a stack into a
    replica's state, and the next read failed; a backup resumes on 3 replicas from 2."""
    expected = pearson_run(ds.get_strategy())
    mirrored = pearson_run(ds.MirroredStrategy(["cpu:0", "cpu:1"]), [callbacks.BackupAndRestore(str(tmp_path / "a"))])
    for key, values in expected.items():
        assert mirrored[key] == pytest.approx(values, abs=1e-5), key
    backup = callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=1)
    with pytest.raises(KeyboardInterrupt):
        pearson_run(ds.MirroredStrategy(["cpu:0", "cpu:1"]), [backup, InterruptAt(6)])
    resumed = pearson_run(
        ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]), [callbacks.BackupAndRestore(str(tmp_path / "b"))]
    )
    for key, values in expected.items():
        assert resumed[key][-1] == pytest.approx(values[-1], abs=1e-5), key


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_metrics_made_of_metrics_combine_the_states_inside(strategy_name):
    """MeanSquaredError() + MeanAbsoluteError() and a wrapper keep their states in the metrics inside them (they
    logged NaN: the reader's inner metrics never saw the data)."""
    from torchmetrics.regression import MeanAbsoluteError
    from torchmetrics.wrappers import LambdaInputTransformer

    def made():
        return [MeanSquaredError() + MeanAbsoluteError(), LambdaInputTransformer(MeanSquaredError(), lambda p: p * 2)]

    torch.manual_seed(0)
    x, y = torch.randn(18, 3), torch.randn(18, 1)
    model = torch.nn.Linear(3, 1)
    trainer = Trainer(strategy=make_strategy(strategy_name), loss="mse", metrics=made())
    logs = trainer.evaluate(model, (x, y), batch_size=8, verbose=0, return_dict=True)
    with torch.no_grad():
        predictions = model(x)
    for metric, key in zip(made(), ("compositional_metric", "lambda_input_transformer")):
        metric.update(predictions, y)
        assert logs[key] == pytest.approx(float(metric.compute()), abs=1e-6), key


def test_unreduced_list_states_keep_each_element():
    """A list state without a reduction holds one element per example, as torchmetrics keeps them."""
    import torchmetrics

    class Items(torchmetrics.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("items", default=[], dist_reduce_fx=None)

        def update(self, preds, target):
            self.items.extend((preds - target).abs().reshape(-1))

        def compute(self):
            return torch.tensor(float(len(self.items)))

    metric = TorchMetric(Items())
    metric.build(ds.MirroredStrategy(["cpu:0", "cpu:1"]))
    metric.update_state(torch.zeros(6), torch.ones(6))
    metric.update_state(torch.zeros(4), torch.ones(4))
    assert float(metric.result()) == 10.0


def test_the_input_order_holds_when_a_replica_has_no_rows_at_a_middle_step():
    """Replica 1's rows of the first step weigh 0: its later rows must not slide into the first step's place."""
    x, y = torch.randn(8, 4), torch.arange(8, dtype=torch.float32).reshape(-1, 1) / 100
    weights = torch.ones(8)
    weights[2:4] = 0
    expected = float(sum((i / 100) * (n + 1) for n, i in enumerate([0, 1, 4, 5, 6, 7])))
    for name in ("default", "mirrored2"):
        torch.manual_seed(0)
        trainer = Trainer(
            strategy=make_strategy(name), optimizer=optimizers.SGD(0.0), loss="mse", metrics=[scenarios.OrderedSum()]
        )
        history = trainer.fit(torch.nn.Linear(4, 1), (x, y, weights), batch_size=4, shuffle=False, verbose=0)
        assert history.history["ordered_sum"][0] == pytest.approx(expected, rel=1e-6), name


def test_two_metrics_of_one_name_are_told_apart():
    """MulticlassAccuracy(top_k=1) and (top_k=3): the second is logged as multiclass_accuracy_1 (Keras 2's
    suffix), not over the first."""
    from torchmetrics.classification import MulticlassAccuracy

    (x, y), _ = scenarios.classification_data()
    model = scenarios.classifier()
    trainer = Trainer(
        loss="cross_entropy",
        metrics=[MulticlassAccuracy(num_classes=3, top_k=1), MulticlassAccuracy(num_classes=3, top_k=2)],
    )
    logs = trainer.evaluate(model, (x, y), batch_size=32, verbose=0, return_dict=True)
    with torch.no_grad():
        logits = model(x)
    for key, k in (("multiclass_accuracy", 1), ("multiclass_accuracy_1", 2)):
        metric = MulticlassAccuracy(num_classes=3, top_k=k)
        metric.update(logits, y)
        assert logs[key] == pytest.approx(float(metric.compute()), abs=1e-6), key


def test_a_metric_first_used_inside_the_replicas_says_to_build_it():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    metric = TorchMetric(MulticlassF1Score(num_classes=3))
    with pytest.raises(RuntimeError, match=r"before it was built.*metric.build\(strategy\)"):
        strategy.run(lambda: metric.update_state(torch.tensor([0, 1]), torch.randn(2, 3)))
