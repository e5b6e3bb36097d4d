"""Hugging Face ``datasets`` as the input of ``Trainer.fit``, ``evaluate`` and ``predict``: a ``Dataset`` in any
format with ``batch_size`` trains exactly as a ``DataLoader`` over it does (a tiny GPT-2 with its own loss), with
or without a collator (``data.CollatedDataset``), on ragged rows with one, under one device and Mirrored(2); a
``DatasetDict`` split validates; an ``IterableDataset`` streams; bad rows get an error naming the column and the
fix; and two workers each read only their rows (or their shard of a stream), equal to one process."""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import mw_hf_scenarios as scenarios  # noqa: E402 - needs the libraries checked above
import torch  # noqa: E402
from conftest import make_strategy  # noqa: E402
from multiworker_harness import results, run_workers  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import replicafit.strategies as ds  # noqa: E402
from replicafit import data  # noqa: E402
from replicafit.data import InputWorkers, sharding  # noqa: E402

BATCH = scenarios.BATCH
TOLERANCE = 1e-6
STRATEGIES = ["default", "mirrored2"]


def fit(source, strategy_name: str = "default", **kwargs):
    """The loss history and weights of the tiny GPT-2 after ``fit`` on ``source`` (in order, seeds fixed)."""
    model = scenarios.tiny_gpt2()
    trainer = scenarios.make_trainer(make_strategy(strategy_name))
    history = trainer.fit(model, source, shuffle=False, verbose=0, **kwargs)
    return history.history, scenarios.weights_of(model)


def assert_same(got, expected, tolerance=TOLERANCE):
    (history, weights), (expected_history, expected_weights) = got, expected
    assert history.keys() == expected_history.keys()
    for key, values in expected_history.items():
        assert history[key] == pytest.approx(values, abs=tolerance), key
    for key, value in expected_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=tolerance, msg=key)


@pytest.mark.parametrize("strategy_name, formats", [("default", (None, "numpy", "torch")), ("mirrored2", ("torch",))])
def test_a_dataset_in_any_format_trains_as_a_dataloader_over_it(strategy_name, formats):
    """The issue's case (torch format, batch_size=8: the batch used to reach GPT-2 without its batch
    dimension), and the Python and NumPy formats: the batches of DataLoader(ds, batch_size=8)."""
    rows = scenarios.token_rows()
    loader = DataLoader(rows.with_format("torch"), batch_size=BATCH)
    expected = fit(loader, strategy_name)
    assert len(expected[0]["loss"]) == 1
    for form in formats:
        # the same batches: one dict per batch (x; its labels go to forward with the inputs), the same tensors
        for got, batch in zip(data.as_global_batches(rows.with_format(form), batch_size=BATCH), loader, strict=True):
            assert got.keys() == batch.keys() == {"input_ids", "labels"}
            for key, value in batch.items():
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        assert_same(fit(rows.with_format(form), strategy_name, batch_size=BATCH), expected)


@pytest.mark.parametrize(
    "case, strategy_name",
    [
        ("fixed rows, a function", "default"),
        ("ragged rows, a function", "mirrored2"),
        ("ragged rows, transformers", "default"),
        ("ragged rows, transformers", "mirrored2"),
    ],
)
def test_a_collator_with_fits_batching_equals_the_dataloader_route(case, strategy_name):
    rows = scenarios.token_rows(ragged=case.startswith("ragged")).with_format("torch")
    collator = scenarios.language_model_collator() if case.endswith("transformers") else scenarios.pad_rows
    expected = fit(DataLoader(rows, batch_size=BATCH, collate_fn=collator), strategy_name)
    assert_same(fit(data.CollatedDataset(rows, collator), strategy_name, batch_size=BATCH), expected)


def test_collate_rows_gives_one_batch_for_every_format():
    """Each column stacked (a list is a value, not a structure), nested columns too, the same in every format."""
    rows = datasets.Dataset.from_dict(
        {
            "input_ids": [[1, 2, 3], [4, 5, 6]],
            "score": np.array([0.5, 1.5], np.float32),
            "label": [0, 1],
            "extra": [{"mask": [1, 0]}, {"mask": [1, 1]}],
        }
    )
    batches = [data.collate_rows([rows.with_format(form)[i] for i in range(2)]) for form in (None, "numpy", "torch")]
    for batch in batches:
        assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 6]] and batch["input_ids"].dtype == torch.int64
        assert batch["score"].tolist() == [0.5, 1.5] and batch["score"].dtype == torch.float32
        assert batch["label"].tolist() == [0, 1]
        assert batch["extra"]["mask"].tolist() == [[1, 0], [1, 1]]
    assert data.collate_rows([(np.ones(2), 1), (np.zeros(2), 0)])[1].tolist() == [1, 0]  # tuples: columns


def test_ragged_rows_without_a_collator_and_strings_get_the_column_and_the_fix():
    ragged = scenarios.token_rows(ragged=True)
    with pytest.raises(ValueError, match=r"'input_ids' has rows of different shapes.*pads them.*CollatedDataset"):
        fit(ragged, batch_size=BATCH)
    texts = scenarios.token_rows().add_column("text", [f"row {i}" for i in range(scenarios.ROWS)])
    with pytest.raises(ValueError, match=r"'text' holds strings.*remove_columns\(\['text'\]\).*CollatedDataset"):
        fit(texts.with_format("torch"), batch_size=BATCH)
    splits = datasets.DatasetDict(train=ragged, validation=ragged)
    with pytest.raises(ValueError, match=r"named splits \(train, validation\).*dataset_dict\['train'\]"):
        fit(splits, batch_size=BATCH)
    with pytest.raises(ValueError, match="needs a batch_size"):
        fit(scenarios.token_rows())
    with pytest.raises(ValueError, match="needs a batch_size"):
        fit(scenarios.token_rows().to_iterable_dataset())
    with pytest.raises(TypeError, match="collate_fn must be callable"):
        data.CollatedDataset(ragged, "pad")


@pytest.mark.parametrize("strategy_name", STRATEGIES)
def test_a_datasetdict_split_validates_and_evaluate_and_predict_read_every_row_in_order(strategy_name):
    rows = scenarios.token_rows(28)
    splits = datasets.DatasetDict(train=rows.select(range(20)), validation=rows.select(range(20, 28)))
    splits = splits.with_format("torch")
    model = scenarios.tiny_gpt2()
    trainer = scenarios.make_trainer(make_strategy(strategy_name))
    history = trainer.fit(
        model, splits["train"], batch_size=BATCH, epochs=2, validation_data=splits["validation"], verbose=0
    )
    assert len(history.history["val_loss"]) == 2
    evaluation = trainer.evaluate(model, splits["validation"], batch_size=3, verbose=0, return_dict=True)
    assert evaluation["loss"] == pytest.approx(history.history["val_loss"][-1], abs=TOLERANCE)
    predictions = trainer.predict(model, splits["validation"], batch_size=3)  # batches of 3, 3 and 2 rows
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=splits["validation"][:]["input_ids"]).logits
    torch.testing.assert_close(predictions, expected, rtol=1e-5, atol=1e-5)


def test_validation_split_of_a_dataset_keeps_its_last_rows():
    rows = scenarios.token_rows().with_format("numpy")
    expected = fit(rows.select(range(16)), batch_size=BATCH, validation_data=rows.select(range(16, 20)))
    assert_same(fit(rows, batch_size=BATCH, validation_split=0.2), expected)


def test_an_iterable_dataset_trains_as_the_dataset_in_order():
    rows = scenarios.token_rows()
    expected = fit(rows, batch_size=BATCH, epochs=2)
    stream = rows.to_iterable_dataset(num_shards=2)
    model = scenarios.tiny_gpt2()
    history = scenarios.make_trainer().fit(model, stream, batch_size=BATCH, epochs=2, verbose=0)  # (shuffle=True)
    assert_same((history.history, scenarios.weights_of(model)), expected)  # a stream is read in its own order
    ragged = scenarios.token_rows(ragged=True).to_iterable_dataset()
    collated = data.CollatedDataset(ragged, scenarios.pad_rows)
    expected = fit(DataLoader(ragged, batch_size=BATCH, collate_fn=scenarios.pad_rows), "mirrored2")
    assert_same(fit(collated, "mirrored2", batch_size=BATCH), expected)


def test_a_workers_part_of_a_stream_is_its_shard_batched_by_its_share():
    """One process standing for worker 1 of 2 (``InputWorkers``): fit's ``IterableBatches`` and a ``DataLoader``
    over the stream read only that worker's shard; with fewer shards than workers every worker reads the stream
    and keeps one example in two (said in a warning), instead of leaving a worker without data."""
    worker = InputWorkers(["cpu:0"], num_workers=2, worker_index=1)
    rows = scenarios.token_rows(row_ids=True).to_iterable_dataset(num_shards=2)
    plan = sharding.plan(data.as_global_batches(rows, batch_size=BATCH), worker, data.AutoShardPolicy.AUTO)
    assert plan.kind == "shards"
    assert [batch["row"].tolist() for batch in plan.reader] == [[10, 11, 12, 13], [14, 15, 16, 17], [18, 19]]
    plan = sharding.plan(DataLoader(rows, batch_size=BATCH), worker, data.AutoShardPolicy.AUTO)
    assert [batch["row"].tolist() for batch in plan.reader] == [list(range(10, 18)), [18, 19]]
    one_shard = scenarios.token_rows(row_ids=True).to_iterable_dataset(num_shards=1)
    first = InputWorkers(["cpu:0"], num_workers=2, worker_index=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = sharding.plan(data.as_global_batches(one_shard, batch_size=BATCH), first, data.AutoShardPolicy.AUTO)
    assert any("not a multiple of the 2 workers" in str(w.message) for w in caught)
    assert [row for batch in plan.reader for row in batch["row"].tolist()] == list(range(0, 20, 2))


@pytest.fixture(scope="module")
def two_workers():
    """Both scenarios on two MultiWorkerMirroredStrategy workers (one interpreter start each), and the map-style
    one under Mirrored(2) in this process: what two workers must equal."""
    workers = results(run_workers(scenarios.__file__, "two_workers", 2, timeout=150))
    return workers, scenarios.map_style_run(ds.MirroredStrategy(["cpu:0", "cpu:1"]))


@pytest.mark.timeout(200)
def test_two_workers_read_each_row_once_per_epoch_and_equal_one_process(two_workers):
    workers, expected = two_workers
    assert all(scenarios.each_once(epoch) for epoch in expected["reads"]["fit"])  # one process: every row, once
    got = [worker["map_style"] for worker in workers]
    for epoch in range(2):
        assert [len(g["reads"]["fit"][epoch]) for g in got] == [10, 10]  # 20 rows in batches 8, 8, 4: 4 + 4 + 2 each
        assert scenarios.each_once(*(g["reads"]["fit"][epoch] for g in got)), epoch
    for phase in ("evaluate", "predict"):
        assert scenarios.each_once(*(g["reads"][phase] for g in got)), phase
    for g in got:
        assert_same((g["history"], g["weights"]), (expected["history"], expected["weights"]))
        assert g["evaluate"]["loss"] == pytest.approx(expected["evaluate"]["loss"], abs=TOLERANCE)
        torch.testing.assert_close(g["predict"], expected["predict"], rtol=1e-5, atol=1e-5)  # every row, in order
        # ragged rows padded by each worker for its own rows only: the padding is masked, the training the same
        assert_same(({}, g["padded"]), ({}, expected["padded"]))


@pytest.mark.timeout(200)
def test_two_workers_each_read_their_shard_of_a_stream(two_workers):
    workers, _ = two_workers
    reads = [worker["stream"]["reads"] for worker in workers]
    assert reads == [list(range(0, 10)) * 2, list(range(10, 20)) * 2]  # to_iterable_dataset(num_shards=2): contiguous
    assert collections.Counter(reads[0] + reads[1]) == collections.Counter(list(range(20)) * 2)
    histories = [worker["stream"]["history"] for worker in workers]
    assert histories[0] == histories[1] and len(histories[0]["loss"]) == 2


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_predict_on_batches_padded_each_to_its_own_length_says_to_pad_to_one(strategy_name):
    """Each batch (and replica) padded to its longest row gives outputs that cannot be put together: the
    message says so and names the fix, instead of torch's "Sizes of tensors must match"."""
    ragged = data.CollatedDataset(scenarios.token_rows(ragged=True), scenarios.pad_rows)
    trainer = scenarios.make_trainer(make_strategy(strategy_name))
    with pytest.raises(ValueError, match=r"differ beyond the first axis.*padding='max_length'"):
        trainer.predict(scenarios.tiny_gpt2(), ragged, batch_size=BATCH)
