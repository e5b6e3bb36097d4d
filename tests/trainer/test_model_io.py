"""Models that take and return dicts (``trainer/model_io.py``): a dict of inputs as keyword arguments when
``forward`` names its keys (Hugging Face's convention) or as one argument (Keras'); a ``ModelOutput`` (or a
dict with ``logits``) gives its logits to losses, metrics and ``predict``; Keras multi-output dicts stay; a
Hugging Face model trains through ``fit`` with no wrapper, alike under every strategy."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import pytest
import torch
from conftest import make_strategy

import replicafit.strategies as ds
from replicafit.trainer import Trainer, model_io, summary
from replicafit.trainer.model_io import (
    AS_IS,
    OutputSelection,
    call_model,
    inputs_with_labels,
    is_model_output,
    model_loss,
    passes_keywords,
    prediction_of,
    select_outputs,
)

pytestmark = pytest.mark.timeout(120)

N, LENGTH, VOCAB, CLASSES = 20, 6, 50, 3
_g = torch.Generator().manual_seed(1)
IDS = torch.randint(1, VOCAB, (N, LENGTH), generator=_g)
MASK = torch.ones(N, LENGTH, dtype=torch.long)
MASK[::3, 4:] = 0
Y = torch.randint(0, CLASSES, (N,), generator=_g)
INPUTS = {"input_ids": IDS, "attention_mask": MASK}


def no_replica_frames(info) -> bool:
    return not any("strategies" in str(entry.path) for entry in info.traceback)


@dataclasses.dataclass
class ModelOutput(OrderedDict):
    """A stand-in for ``transformers.utils.ModelOutput``: an ``OrderedDict`` dataclass whose keys are its
    fields that are not None, with ``to_tuple`` (no ``transformers`` import)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: tuple | None = None
    hidden_states: torch.Tensor | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value

    def to_tuple(self) -> tuple:
        return tuple(self[key] for key in self.keys())


class _Bag(torch.nn.Module):
    """Mean of the unmasked tokens' embeddings, then a linear head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, CLASSES)

    def logits(self, input_ids, attention_mask):
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))


class NamedInputs(_Bag):
    def forward(self, input_ids, attention_mask):
        return self.logits(input_ids, attention_mask)


class KwargsInputs(_Bag):
    def forward(self, input_ids, **kwargs):
        return self.logits(input_ids, kwargs["attention_mask"])


class OneDictInput(_Bag):  # Keras' convention: the dict is the one argument
    def forward(self, inputs):
        return self.logits(inputs["input_ids"], inputs["attention_mask"])


class ReturnsModelOutput(_Bag):
    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        logits = self.logits(input_ids, attention_mask)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        hidden = self.embed(input_ids)
        return ModelOutput(loss=loss, logits=logits, past_key_values=(hidden, hidden), hidden_states=hidden)


# --- inputs: keyword arguments or one argument ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, keywords",
    [(NamedInputs(), True), (KwargsInputs(), True), (OneDictInput(), False), (ReturnsModelOutput(), True)],
    ids=["forward(input_ids, attention_mask)", "forward(input_ids, **kwargs)", "forward(inputs)", "model_output"],
)
def test_a_dict_goes_as_keywords_when_forward_names_its_keys_else_as_one_argument(model, keywords):
    assert passes_keywords(model, INPUTS) is keywords
    expected = model.logits(IDS, MASK)
    torch.testing.assert_close(prediction_of(call_model(model, INPUTS)), expected)


def test_kwargs_alone_do_not_make_keywords_of_a_dict_forward_does_not_name():
    class Keras(torch.nn.Module):
        def forward(self, inputs, **kwargs):
            return inputs["a"]

    class OnlyKwargs(torch.nn.Module):
        def forward(self, **kwargs):
            return kwargs["a"]

    x = {"a": torch.ones(2, 1), "b": torch.zeros(2, 1)}
    assert passes_keywords(Keras(), x) is False  # names no key: one argument, **kwargs or not
    assert passes_keywords(OnlyKwargs(), x) is True  # cannot take one argument at all
    torch.testing.assert_close(call_model(Keras(), x), x["a"])
    torch.testing.assert_close(call_model(OnlyKwargs(), x), x["a"])
    assert passes_keywords(Keras(), torch.ones(2)) is False
    assert passes_keywords(Keras(), {0: torch.ones(2)}) is False  # keys that are not names


def test_the_decision_is_cached_per_forward_and_key_set(monkeypatch):
    calls = []
    decide = model_io._decide_keywords
    monkeypatch.setattr(model_io, "_decide_keywords", lambda *args: calls.append(args[1]) or decide(*args))

    class Fresh(NamedInputs):  # a forward of its own: nothing cached yet
        def forward(self, input_ids, attention_mask=None):
            return self.logits(input_ids, attention_mask)

    for model in (Fresh(), Fresh(), ds.get_strategy().distribute_module(Fresh())):
        assert passes_keywords(model, INPUTS)
    assert passes_keywords(Fresh(), {"input_ids": IDS})
    assert calls == [("input_ids", "attention_mask"), ("input_ids",)]


def test_a_dict_that_forward_names_in_part_is_refused_naming_the_unknown_keys():
    x = {"input_ids": IDS, "attention_mask": MASK, "token_types": IDS}
    with pytest.raises(
        TypeError,
        match=r"forward\(input_ids, attention_mask\) names the keys \['input_ids', 'attention_mask'\] of the input "
        r"dict but not \['token_types'\].*Drop or rename the keys \['token_types'\] \(forward accepts "
        r"\['input_ids', 'attention_mask'\]\), or give NamedInputs.forward those parameters or \*\*kwargs",
    ):
        passes_keywords(NamedInputs(), x)
    with pytest.raises(TypeError, match=r"but not \['token_types'\]") as info:
        Trainer(strategy=make_strategy("mirrored2")).fit(NamedInputs(), (x, Y), batch_size=8, verbose=0)
    assert no_replica_frames(info)  # said at the entry, before any replica runs


@pytest.mark.parametrize("model_class", [NamedInputs, KwargsInputs, OneDictInput])
def test_fit_evaluate_and_predict_take_a_dict_of_inputs_either_way(model_class):
    trainer = Trainer(strategy=make_strategy("mirrored2"), loss="cross_entropy", metrics=["accuracy"], seed=0)
    model = model_class()
    history = trainer.fit(model, (INPUTS, Y), batch_size=8, epochs=2, verbose=0)
    assert set(history.history) == {"loss", "accuracy"}
    assert history.history["loss"][1] < history.history["loss"][0]
    logs = trainer.evaluate(model, (INPUTS, Y), batch_size=8, return_dict=True, verbose=0)
    predictions = trainer.predict(model, INPUTS, batch_size=8, verbose=0)
    with torch.no_grad():
        torch.testing.assert_close(predictions, model.logits(IDS, MASK))
    expected = torch.nn.functional.cross_entropy(predictions, Y).item()
    assert logs["loss"] == pytest.approx(expected, rel=1e-5)


# --- outputs: logits, only tensor, or Keras' multi-output ---------------------------------------------------------
def test_a_model_output_is_recognised_without_transformers():
    output = ModelOutput(logits=torch.zeros(2, 3), past_key_values=(torch.ones(1),))
    assert is_model_output(output)
    assert list(output) == ["logits", "past_key_values"]
    assert not is_model_output({"logits": torch.zeros(2, 3)})
    assert not is_model_output(ModelOutput)  # the class is not an output
    assert not is_model_output(torch.zeros(2))


T = torch.zeros(2, 3)
U = torch.ones(2, 1)


@pytest.mark.parametrize(
    "output, loss, labels, selection",
    [
        (T, "mse", T, AS_IS),
        ((T, U), "mse", (T, U), AS_IS),  # a tuple: Keras' multi-output
        ({"a": T, "b": U}, "mse", {"a": T, "b": U}, AS_IS),  # labels name the outputs: Keras
        ({"a": T, "b": U}, {"a": "mse", "b": "mae"}, None, AS_IS),  # a loss per output: Keras
        ({"a": T, "b": U, "cache": U}, {"a": "mse", "b": "mae"}, None, OutputSelection(keys=("a", "b"))),
        ({"a": T, "b": U}, "mse", None, AS_IS),  # predict of a Keras multi-output model: the dict
        ({"logits": T, "loss": U, "cache": (U,)}, "cross_entropy", T, OutputSelection(key="logits")),
        ({"out": T, "loss": U}, "mse", T, OutputSelection(key="out")),  # its only tensor
        (ModelOutput(logits=T, past_key_values=(U,), hidden_states=U), "mse", T, OutputSelection(key="logits")),
        (ModelOutput(hidden_states=T, past_key_values=(U,)), "mse", None, OutputSelection(key="hidden_states")),
        (ModelOutput(logits=T, hidden_states=U), "mse", {"logits": T}, OutputSelection(keys=("logits",))),
    ],
    ids=[
        "tensor",
        "tuple",
        "dict_labels",
        "dict_loss",
        "dict_loss_extra_entry",
        "dict_predict",
        "dict_logits",
        "dict_only_tensor",
        "model_output_logits",
        "model_output_only_tensor",
        "model_output_dict_labels",
    ],
)
def test_what_losses_metrics_and_predict_take_of_an_output(output, loss, labels, selection):
    assert select_outputs(output, loss, labels) == selection


def test_outputs_that_cannot_be_read_are_told_why():
    with pytest.raises(ValueError, match=r"The loss name the model's outputs \['a', 'c'\].*without \['c'\]"):
        select_outputs({"a": T, "b": U}, {"a": "mse", "c": "mse"})
    entries = r"\['loss', 'past_key_values', 'hidden_states'\]"
    with pytest.raises(ValueError, match=rf"ModelOutput with the entries {entries}, and no 'logits'"):
        select_outputs(ModelOutput(loss=U, past_key_values=T, hidden_states=T), "mse", T)
    with pytest.raises(ValueError, match=r"The labels name the model's outputs \['a'\].*without \['a'\]"):
        select_outputs(ModelOutput(logits=T, hidden_states=T), "mse", {"a": T})


def test_a_dict_of_several_outputs_with_tensor_labels_is_told_to_name_them():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

        def forward(self, x):
            return {"a": self.a(x), "b": self.b(x)}

    with pytest.raises(
        ValueError,
        match=r"returns a dict with the entries \['a', 'b'\] on the first batch of fit\(\).*a multi-output model "
        r"\(Keras' convention\).*Pass the labels as \{'a': \.\.\., 'b': \.\.\.\}, or return the prediction "
        r"under 'logits'",
    ) as info:
        Trainer(strategy=make_strategy("mirrored2")).fit(TwoHeads(), (torch.ones(8, 4), Y[:8]), verbose=0)
    assert no_replica_frames(info)


class TwoHeadsAndACache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 1)

    def forward(self, x):
        return {"a": self.a(x), "b": self.b(x), "cache": (x,)}


@pytest.mark.parametrize("named_by", ["loss", "labels"])
def test_a_keras_multi_output_dict_keeps_its_outputs_and_leaves_out_extra_entries(named_by):
    x, ya, yb = torch.randn(12, 4), torch.randn(12, 2), torch.randn(12, 1)
    loss = {"a": "mse", "b": "mae"} if named_by == "loss" else "mse"
    trainer = Trainer(strategy=make_strategy("mirrored2"), optimizer="sgd", loss=loss, metrics=["mae"])
    model = TwoHeadsAndACache()
    logs = trainer.evaluate(model, (x, {"a": ya, "b": yb}), batch_size=4, return_dict=True, verbose=0)
    assert set(logs) == {"loss", "a_loss", "b_loss", "a_mae", "b_mae"}
    with torch.no_grad():
        pa, pb = model.a(x), model.b(x)
    assert logs["a_loss"] == pytest.approx((pa - ya).pow(2).mean().item(), rel=1e-5)
    expected_b = (pb - yb).abs().mean() if named_by == "loss" else (pb - yb).pow(2).mean()
    assert logs["b_loss"] == pytest.approx(expected_b.item(), rel=1e-5)
    history = trainer.fit(model, (x, {"a": ya, "b": yb}), batch_size=4, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


@pytest.mark.parametrize("strategy_name", ["default", "mirrored2"])
def test_a_model_output_gives_its_logits_and_its_extra_outputs_are_ignored(strategy_name):
    trainer = Trainer(strategy=make_strategy(strategy_name), loss="cross_entropy", metrics=["accuracy"], seed=0)
    model = ReturnsModelOutput()
    history = trainer.fit(model, (INPUTS, Y), batch_size=8, epochs=2, verbose=0)
    assert set(history.history) == {"loss", "accuracy"}  # one output: no past_key_values_loss...
    assert history.history["loss"][1] < history.history["loss"][0]
    predictions = trainer.predict(model, INPUTS, batch_size=8, verbose=0)
    with torch.no_grad():
        torch.testing.assert_close(predictions, model.logits(IDS, MASK))


def test_under_mixed_precision_predict_returns_float32_logits():
    trainer = Trainer(loss="cross_entropy", metrics=["accuracy"], precision="bf16-mixed", seed=0)
    model = ReturnsModelOutput()
    trainer.fit(model, (INPUTS, Y), batch_size=8, verbose=0)
    predictions = trainer.predict(model, INPUTS, batch_size=8, verbose=0)
    assert predictions.dtype == torch.float32 and predictions.shape == (N, CLASSES)


# --- the model's own loss (Trainer(loss=None)) ---------------------------------------------------------------------
def test_model_loss_reads_the_loss_a_model_returns_with_its_labels():
    model = ReturnsModelOutput()
    x = inputs_with_labels(model, INPUTS, Y)
    assert list(x) == ["input_ids", "attention_mask", "labels"] and x["labels"] is Y
    output = call_model(model, x)
    torch.testing.assert_close(model_loss(output), torch.nn.functional.cross_entropy(model.logits(IDS, MASK), Y))
    assert inputs_with_labels(model, x, Y) is x  # labels already there
    assert inputs_with_labels(NamedInputs(), INPUTS, Y) is INPUTS  # forward names no labels
    assert inputs_with_labels(model, INPUTS, None) is INPUTS
    with pytest.raises(
        ValueError,
        match=r"Trainer\(loss=None\) trains on the loss the model returns, but the model returned a ModelOutput with "
        r"the entries \['logits', 'past_key_values', 'hidden_states'\], without a 'loss'\. Put the labels into the "
        r"input dict.*or pass a loss: Trainer\(loss='cross_entropy'\)",
    ):
        model_loss(call_model(model, INPUTS))
    with pytest.raises(ValueError, match=r"returned a Tensor of shape \[20, 3\], without a 'loss'"):
        model_loss(torch.zeros(N, CLASSES))


# --- model summary ---------------------------------------------------------------------------------------------------
def test_summary_calls_a_model_with_a_dict_as_the_trainer_does():
    for model in (NamedInputs(), OneDictInput()):
        info = summary(model, input_data=INPUTS, print_fn=None)
        assert not info.note, info.note
        shapes = {layer.name: layer.output_shape for layer in info.layers}
        assert shapes["head"] == "(None, 3)"


# --- a Hugging Face model, with no wrapper -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")  # imported once for the module (slow)


def tiny_bert(transformers):
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        num_labels=CLASSES,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


def test_a_hugging_face_model_trains_alike_under_every_strategy_and_predicts_logits(transformers):
    results = []
    for strategy in (ds.get_strategy(), ds.MirroredStrategy(["cpu:0", "cpu:1"])):
        model = tiny_bert(transformers)
        trainer = Trainer(strategy=strategy, loss="cross_entropy", metrics=["accuracy"], seed=0)
        history = trainer.fit(model, (INPUTS, Y), batch_size=8, epochs=2, verbose=0)
        assert set(history.history) == {"loss", "accuracy"}
        predictions = trainer.predict(model, INPUTS, batch_size=8, verbose=0)
        assert isinstance(predictions, torch.Tensor) and predictions.shape == (N, CLASSES)
        with torch.no_grad():
            torch.testing.assert_close(predictions, model(**INPUTS).logits)
        results.append((history.history, model.state_dict()))
    (history, weights), (mirrored_history, mirrored_weights) = results
    assert mirrored_history["loss"] == pytest.approx(history["loss"], rel=1e-5)
    assert mirrored_history["accuracy"] == history["accuracy"]
    for name, value in weights.items():
        torch.testing.assert_close(mirrored_weights[name], value, atol=1e-6, rtol=0, msg=name)
    initial = tiny_bert(transformers).state_dict()
    assert any(not torch.equal(value, initial[name]) for name, value in weights.items())  # it trained


def test_a_hugging_face_output_and_its_loss_are_read_without_a_wrapper(transformers):
    model = tiny_bert(transformers).eval()
    output = call_model(model, inputs_with_labels(model, INPUTS, Y))
    assert is_model_output(output) and set(output) >= {"loss", "logits"}
    assert prediction_of(output).shape == (N, CLASSES)
    torch.testing.assert_close(model_loss(output), torch.nn.functional.cross_entropy(output.logits, Y))
    info = summary(model, input_data=INPUTS, print_fn=None)
    assert not info.note and info.layers[-1].output_shape == "(None, 3)"
