"""A tiny randomly initialised GPT-2 through ``fit``, with no wrapper: its language-model loss over padded
batches equals a plain torch loop on the same global batches, with our ``ignore_class`` loss (labels
shifted by the data) and with the model's own loss (``Trainer(loss=None)``, Hugging Face's
``num_items_in_batch``), under one device and Mirrored(2), and with an accumulation window."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import make_strategy
from test_model_io import tiny_bert

from replicafit import optimizers
from replicafit.trainer import Trainer, losses

VOCAB, LENGTH, ROWS, BATCH = 40, 9, 20, 8
TOLERANCE = 2e-6


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")  # imported once for the module (slow)


def tiny_gpt2(transformers):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def sequences():
    """Token ids padded on the right (0) and their lengths (3 .. LENGTH)."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=generator)
    padding = torch.arange(LENGTH) >= lengths[:, None]
    return ids.masked_fill(padding, 0), ~padding


def torch_loop(model, steps) -> dict:
    """Plain torch: ``steps(model)`` yields each global batch's loss; SGD with momentum on each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    for loss in steps(model):
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.state_dict()


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("name", ["default", "mirrored2"])
def test_shifted_by_the_data_with_ignore_class_equals_a_torch_loop(transformers, name):
    ids, real = sequences()
    inputs, labels = ids[:, :-1], ids[:, 1:].masked_fill(~real[:, 1:], -100)

    def steps(model):
        for start in range(0, ROWS, BATCH):
            logits = model(input_ids=inputs[start : start + BATCH]).logits
            yield F.cross_entropy(logits.transpose(1, 2), labels[start : start + BATCH])

    expected = torch_loop(tiny_gpt2(transformers), steps)
    model = tiny_gpt2(transformers)
    optimizer = optimizers.SGD(0.5, momentum=0.5)
    loss = losses.SparseCategoricalCrossentropy(ignore_class=-100)  # GPT-2's logits: classes last
    trainer = Trainer(strategy=make_strategy(name), optimizer=optimizer, loss=loss, metrics=["accuracy"], seed=0)
    history = trainer.fit(model, (inputs, labels), batch_size=BATCH, shuffle=False, verbose=0)
    assert largest_difference(model.state_dict(), expected) <= TOLERANCE
    assert 0.0 <= history.history["accuracy"][0] <= 1.0


@pytest.mark.parametrize("name,accumulation", [("default", None), ("mirrored2", None), ("mirrored2", 2)])
def test_the_models_own_loss_with_num_items_in_batch_equals_a_torch_loop(transformers, name, accumulation):
    """``loss=None``: the labels go into the input dict, GPT-2 shifts them itself and divides its sum by the
    ``num_items_in_batch`` it is given; the global count of real shifted labels divides after the reduction.
    Micro-batches of 4 in windows of 2 equal the batches of 8."""
    ids, real = sequences()
    labels = ids.masked_fill(~real, -100)
    data = {"input_ids": ids, "attention_mask": real.long(), "labels": labels}

    def steps(model):
        for start in range(0, ROWS, BATCH):
            yield model(**{key: value[start : start + BATCH] for key, value in data.items()}).loss

    expected = torch_loop(tiny_gpt2(transformers), steps)
    model = tiny_gpt2(transformers)
    optimizer = optimizers.SGD(0.5, momentum=0.5, gradient_accumulation_steps=accumulation)
    trainer = Trainer(strategy=make_strategy(name), optimizer=optimizer, loss=None, metrics=[], seed=0)
    batch_size = BATCH // (accumulation or 1)
    history = trainer.fit(model, data, batch_size=batch_size, shuffle=False, verbose=0)
    assert largest_difference(model.state_dict(), expected) <= TOLERANCE
    with torch.no_grad():
        reference = copy.deepcopy(model)
        real_labels = (labels[:, 1:] != -100).sum()
        total = sum(
            float(reference(**{k: v[s : s + 5] for k, v in data.items()}, num_items_in_batch=1.0).loss)
            for s in range(0, ROWS, 5)
        )
    logs = trainer.evaluate(model, data, batch_size=5, return_dict=True)
    assert abs(logs["loss"] - total / int(real_labels)) < 1e-5  # evaluation: the mean over every real label
    assert len(history.history["loss"]) == 1


class Classifier(torch.nn.Module):
    """A model of one's own that returns its loss, a mean over its examples (no num_items_in_batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(5, 3)

    def forward(self, features, labels=None):
        logits = self.linear(features)
        return {"logits": logits, "loss": None if labels is None else F.cross_entropy(logits, labels)}


def test_a_models_own_per_example_mean_is_weighted_by_each_replicas_rows():
    """Mirrored(3) splits batches of 8 as 3, 3, 2: each replica's mean weighs its rows, as one device's does."""
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(20, 5, generator=generator), torch.randint(0, 3, (20,), generator=generator)

    def steps(model):
        for start in range(0, 20, BATCH):
            yield model(x[start : start + BATCH], y[start : start + BATCH])["loss"]

    expected = torch_loop(Classifier(), steps)
    model = Classifier()
    trainer = Trainer(strategy=make_strategy("mirrored3"), optimizer=optimizers.SGD(0.5, momentum=0.5), loss=None)
    trainer.fit(model, ({"features": x}, y), batch_size=BATCH, shuffle=False, verbose=0)
    assert largest_difference(model.state_dict(), expected) <= TOLERANCE
    with pytest.raises(ValueError, match="loss=None"):
        trainer.compute_loss(y, model(x)["logits"])


def test_sample_weights_with_the_models_own_loss_are_refused():
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    trainer = Trainer(loss=None, metrics=[])
    with pytest.raises(ValueError, match="sample weights cannot reach"):
        trainer.fit(Classifier(), ({"features": x}, y, torch.ones(8)), batch_size=4, verbose=0)


def test_a_classifier_that_ignores_num_items_in_batch_keeps_its_mean(transformers):
    """A Hugging Face classifier takes ``**kwargs`` but returns its own mean whatever ``num_items_in_batch``
    says: probed on the first batch, its loss is weighted by each replica's rows (20 rows in batches of 8:
    a partial last batch), as a torch loop's mean is."""
    reference = tiny_bert(transformers)  # 50 words, 3 classes
    model = copy.deepcopy(reference)
    ids, real = sequences()
    data = {"input_ids": ids, "attention_mask": real.long(), "labels": torch.arange(ROWS) % 3}

    def steps(net):
        for start in range(0, ROWS, BATCH):
            yield net(**{key: value[start : start + BATCH] for key, value in data.items()}).loss

    expected = torch_loop(reference, steps)
    trainer = Trainer(strategy=make_strategy("mirrored2"), optimizer=optimizers.SGD(0.5, momentum=0.5), loss=None)
    trainer.fit(model, data, batch_size=BATCH, shuffle=False, verbose=0)
    assert largest_difference(model.state_dict(), expected) <= TOLERANCE
    assert not trainer._compile_loss.counts_items


def test_the_probe_reads_more_rows_when_the_first_ones_have_no_real_label(transformers):
    """The first 8 rows are all padding: their loss is 0 whatever ``num_items_in_batch`` says, so the probe
    looks at the whole first batch before deciding that the model's loss is a sum."""
    ids, real = sequences()
    labels = ids.masked_fill(~real, -100)
    labels[:8] = -100
    data = {"input_ids": ids, "attention_mask": real.long(), "labels": labels}
    expected = torch_loop(tiny_gpt2(transformers), lambda model: iter([model(**data).loss]))
    model = tiny_gpt2(transformers)
    trainer = Trainer(strategy=make_strategy("mirrored2"), optimizer=optimizers.SGD(0.5, momentum=0.5), loss=None)
    trainer.fit(model, data, batch_size=ROWS, shuffle=False, verbose=0)
    assert trainer._compile_loss.counts_items
    assert largest_difference(model.state_dict(), expected) <= TOLERANCE


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_metrics_compare_the_labels_in_the_inputs_shifted_for_a_causal_model(transformers, strategy_name):
    """``Trainer(loss=None)``: the labels live in the input dict (no y), where the metrics read them too (they
    logged 0.0); a causal model's position t predicts token t + 1, and -100 is left out, as its loss does."""
    from torchmetrics.classification import MulticlassAccuracy

    model = tiny_gpt2(transformers)
    ids, real = sequences()
    labels = ids.masked_fill(~real, -100)
    data = {"input_ids": ids, "attention_mask": real.long(), "labels": labels}
    metrics = ["accuracy", MulticlassAccuracy(num_classes=VOCAB, average="micro", ignore_index=-100)]
    trainer = Trainer(strategy=make_strategy(strategy_name), loss=None, metrics=metrics)
    logs = trainer.evaluate(model, data, batch_size=BATCH, verbose=0, return_dict=True)
    with torch.no_grad():
        predicted = model(input_ids=ids, attention_mask=real.long()).logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    expected = float((predicted == target)[target != -100].float().mean())
    assert logs["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert logs["multiclass_accuracy"] == pytest.approx(expected, abs=1e-6)


def test_a_classifiers_metrics_read_the_labels_in_its_inputs(transformers):
    model = tiny_bert(transformers)
    ids, real = sequences()
    data = {"input_ids": ids, "attention_mask": real.long(), "labels": torch.arange(ROWS) % 3}
    logs = Trainer(loss=None).evaluate(model, data, batch_size=BATCH, verbose=0, return_dict=True)
    with torch.no_grad():
        predicted = model(input_ids=ids, attention_mask=real.long()).logits.argmax(-1)
    assert logs["accuracy"] == pytest.approx(float((predicted == data["labels"]).float().mean()), abs=1e-6)
