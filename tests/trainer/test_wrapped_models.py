"""Wrapped models through ``fit``: a module whose ``forward(*args, **kwargs)`` passes everything to another (PEFT's
``PeftModel`` made without ``task_type`` and its ``LoraModel``, torch.compile's ``OptimizedModule``, a wrapper of
one's own) gets a dict of inputs as the keyword arguments the wrapped module's ``forward`` names
(``model_io.wrapped_module``). A LoRA model trains its adapters alone, with optimizer state for them alone, and its
backups and checkpoints resume; a compiled model trains as the eager one does under every strategy.

The compiled models use ``backend="aot_eager"`` (``wrapped_scenarios.BACKEND`` says why); the models, the data
and the multi-worker scenarios are in ``wrapped_scenarios.py``."""

from __future__ import annotations

import pytest
import torch
import wrapped_scenarios as scenarios
from conftest import InterruptAt, make_strategy
from multiworker_harness import results, run_workers
from wrapped_scenarios import BACKEND, BATCH, TinyLM, lm_data, lora_gpt2, plain_state, tiny_gpt2

from replicafit import optimizers
from replicafit.trainer import BackupAndRestore, ModelCheckpoint, Trainer, model_io
from replicafit.trainer.model_io import call_model, passes_keywords

pytestmark = pytest.mark.timeout(120)

TOLERANCE = 2e-6


@pytest.fixture(scope="module", autouse=True)
def _libraries():
    pytest.importorskip("transformers")
    pytest.importorskip("peft")


def trainer_for(name: str, **kwargs) -> Trainer:
    optimizer = optimizers.SGD(0.2, momentum=0.5)
    return Trainer(strategy=make_strategy(name), optimizer=optimizer, loss=None, metrics=[], seed=0, **kwargs)


def fit(trainer: Trainer, model, callbacks=(), epochs: int = 2, **kwargs):
    return trainer.fit(
        model, lm_data(), batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks), **kwargs
    )


def largest_difference(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


def changed_keys(before: dict, after: dict) -> list:
    return sorted(key for key in before if not torch.equal(before[key], after[key]))


class Wrapper(torch.nn.Module):
    """A wrapper of one's own: everything it is given goes to the module it wraps."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


class IdsOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(scenarios.VOCAB, 4)

    def forward(self, input_ids):
        return self.embed(input_ids)


# --- the rule ------------------------------------------------------------------------------------------------------
def test_a_wrapper_of_ones_own_gets_the_keyword_arguments_its_inner_forward_names():
    """Before the wrapper rule, ``forward(*args, **kwargs)`` named none of the keys: the dict went as one argument,
    which ``TinyLM`` cannot take. Through two wrappers, and under Mirrored(2), it trains as the bare model does."""
    data = lm_data()
    inner = TinyLM()
    model = Wrapper(Wrapper(inner))
    assert model_io.wrapped_module(model) is inner
    assert passes_keywords(model, data)
    torch.testing.assert_close(call_model(model, data)["loss"], inner(**data)["loss"])

    bare = TinyLM()
    fit(trainer_for("mirrored2"), bare)
    wrapped = Wrapper(Wrapper(TinyLM()))
    fit(trainer_for("mirrored2"), wrapped)
    assert largest_difference(plain_state(wrapped.inner.inner.state_dict()), bare.state_dict()) <= TOLERANCE


def test_a_wrapper_whose_inner_forward_lacks_a_key_is_refused_naming_both():
    with pytest.raises(
        TypeError,
        match=r"forward\(input_ids\) names the keys \['input_ids'\] of the input dict but not \['labels'\].*"
        r"give IdsOnly\.forward \(wrapped by Wrapper, Wrapper\) those parameters or \*\*kwargs",
    ):
        passes_keywords(Wrapper(Wrapper(IdsOnly())), lm_data())
    with pytest.raises(TypeError, match=r"but not \['labels'\]"):
        fit(trainer_for("mirrored2"), Wrapper(IdsOnly()), epochs=1)


def test_what_a_wrapper_passes_its_inputs_to():
    """A public ``get_base_model()`` names the wrapped module (PEFT's accessor: a prompt-tuning ``PeftModel`` keeps
    a prompt encoder beside its base model), else the only child does; a wrapper with several children and neither
    is not looked through, and a ``forward`` that takes ``*args`` alone or names a parameter is no wrapper."""
    inner = TinyLM()

    class WithEncoder(Wrapper):
        def __init__(self, inner):
            super().__init__(inner)
            self.prompt_encoder = torch.nn.Embedding(3, 8)

    class Declared(WithEncoder):
        def get_base_model(self):
            return self.inner

    class PositionalOnly(Wrapper):
        def forward(self, *args):
            return self.inner(*args)

    class Keras(Wrapper):  # a dict of inputs is its one argument
        def forward(self, inputs, **kwargs):
            return self.inner(**inputs)

    data = lm_data()
    assert model_io.wrapped_module(Declared(inner)) is inner and passes_keywords(Declared(inner), data)
    assert model_io.wrapped_module(WithEncoder(inner)) is not inner and not passes_keywords(WithEncoder(inner), data)
    assert model_io.wrapped_module(PositionalOnly(inner)) is not inner and not passes_keywords(
        PositionalOnly(inner), data
    )
    assert model_io.wrapped_module(Keras(inner)) is not inner and not passes_keywords(Keras(inner), data)
    assert not passes_keywords(Wrapper(torch.nn.Linear(2, 3)), {"features": torch.ones(1, 2)})  # Keras' inner

    peft_model = lora_gpt2()
    gpt2 = peft_model.get_base_model()
    compiled = torch.compile(peft_model, backend=BACKEND)  # compiled lazily: nothing runs here
    for model in (peft_model, peft_model.base_model, compiled, torch.compile(gpt2, backend=BACKEND)):
        assert model_io.wrapped_module(model) is gpt2
        assert passes_keywords(model, data)


# --- PEFT's LoRA ---------------------------------------------------------------------------------------------------
def torch_loop(model, epochs: int = 2) -> dict:
    """Plain torch on the same global batches: SGD with momentum on the parameters that require gradients."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.2, momentum=0.5)
    data = lm_data()
    for _ in range(epochs):
        for start in range(0, scenarios.ROWS, BATCH):
            optimizer.zero_grad()
            model(**{key: value[start : start + BATCH] for key, value in data.items()}).loss.backward()
            optimizer.step()
    return model.state_dict()


def lora_keys(model) -> list:
    return sorted(name for name, parameter in model.named_parameters() if parameter.requires_grad)


@pytest.mark.parametrize("name", ["default", "mirrored2"])
def test_a_peft_model_without_task_type_trains_its_lora_weights_alone(name):
    """The issue's ``TypeError: The model cannot take the inputs of the first batch`` before the wrapper rule."""
    expected = torch_loop(lora_gpt2())
    model = lora_gpt2()
    assert type(model).__name__ == "PeftModel"  # no task type: forward(*args, **kwargs)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    trainer = trainer_for(name)
    fit(trainer, model)

    after = model.state_dict()
    assert largest_difference(after, expected) <= TOLERANCE
    trained = lora_keys(model)
    assert len(trained) == 2 and all(".lora_" in key for key in trained)
    assert changed_keys(before, after) == trained  # GPT-2's own weights are untouched
    assert sorted(v.name for v in trainer.model.trainable_variables) == trained
    slots = [v.name for v in trainer.optimizer.variables][1:]  # (after iterations)
    assert sorted(slots) == [f"{key}/momentum" for key in trained]  # no slot for a frozen parameter
    assert sorted(entry["name"] for entry in trainer.optimizer.state_dict()["variables"]) == trained  # its checkpoint

    with_task = lora_gpt2(task_type="CAUSAL_LM")  # forward(input_ids=None, ...): trained alike
    fit(trainer_for(name), with_task)
    assert largest_difference(with_task.state_dict(), after) <= TOLERANCE


def test_a_change_of_requires_grad_between_fits_asks_for_a_new_trainer():
    """The trainer's variables and slots are those of the parameters that required gradients when it first ran the
    model: before the check, a newly frozen parameter failed inside backward ("does not require grad") and a newly
    unfrozen one silently stayed as it was. A new trainer trains the new set."""
    model, trainer = lora_gpt2(), trainer_for("mirrored2")
    fit(trainer, model, epochs=1)
    wte = model.get_base_model().transformer.wte.weight
    wte.requires_grad_(True)  # unfreeze the embeddings
    with pytest.raises(ValueError, match=r"\['base_model.model.transformer.wte.weight'\] now require gradients"):
        fit(trainer, model, epochs=1)
    before = wte.detach().clone()
    fit(trainer_for("mirrored2"), model, epochs=1)
    assert not torch.equal(before, wte)
    lora = [p for name, p in model.named_parameters() if ".lora_" in name]
    for parameter in lora:
        parameter.requires_grad_(False)
    with pytest.raises(ValueError, match=r"lora_A.default.weight', .*\] no longer require gradients"):
        fit(trainer, model, epochs=1)


def test_a_lora_backup_resumes_under_mirrored(tmp_path):
    """Interrupted at global step 4 of 6 (3 an epoch, a backup every 2 steps), resumed from the backup of step 4
    by a fresh model and trainer: the same weights and optimizer state as the uninterrupted fit."""
    expected_trainer, expected = trainer_for("mirrored2"), lora_gpt2()
    fit(expected_trainer, expected)

    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        fit(trainer_for("mirrored2"), lora_gpt2(), [BackupAndRestore(backup, save_freq=2), InterruptAt(4)])
    assert (backup / "backup.pt").exists()
    trainer, model = trainer_for("mirrored2"), lora_gpt2()
    fit(trainer, model, [BackupAndRestore(backup, save_freq=2)])
    assert largest_difference(model.state_dict(), expected.state_dict()) <= TOLERANCE
    assert int(trainer.optimizer.iterations) == 6
    slots, expected_slots = trainer.optimizer.state_dict()["slots"], expected_trainer.optimizer.state_dict()["slots"]
    assert len(slots) == 2
    for index, slot in slots.items():
        torch.testing.assert_close(slot["momentum"], expected_slots[index]["momentum"], rtol=0, atol=TOLERANCE)


def test_a_lora_checkpoint_resumes(tmp_path):
    """``ModelCheckpoint``'s file of epoch 1, loaded into a fresh model and trainer, goes on to epoch 2 as the
    uninterrupted fit does; so does ``Trainer.save_checkpoint``'s."""
    expected_trainer, expected = trainer_for("mirrored2"), lora_gpt2()
    fit(expected_trainer, expected, [ModelCheckpoint(tmp_path / "ckpt-{epoch}.pt")])
    first = trainer_for("mirrored2")
    fit(first, lora_gpt2(), epochs=1)
    first.save_checkpoint(tmp_path / "saved.pt")
    for path in (tmp_path / "ckpt-1.pt", tmp_path / "saved.pt"):
        trainer, model = trainer_for("mirrored2"), lora_gpt2(task_type="CAUSAL_LM")  # the same weights' names
        trainer.load_checkpoint(path, model)
        fit(trainer, model, initial_epoch=1)
        assert largest_difference(model.state_dict(), expected.state_dict()) <= TOLERANCE, path


@pytest.mark.timeout(180)
def test_lora_on_two_workers_trains_its_adapters_alone_as_mirrored_two():
    expected = scenarios.worker_fit(0, None, None, model="lora")
    workers = results(run_workers(scenarios.__file__, "worker_fit", 2, timeout=150, kwargs={"model": "lora"}))
    for got in workers:
        assert got["loss"] == expected["loss"]
        assert largest_difference(got["weights"], expected["weights"]) <= TOLERANCE
        assert got["changed"] == expected["changed"] == sorted(got["trainable"])
        assert len(got["changed"]) == 2 and all(".lora_" in key for key in got["changed"])
        assert sorted(got["optimizer_variables"][1:]) == [f"{key}/momentum" for key in got["changed"]]


# --- torch.compile -------------------------------------------------------------------------------------------------
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["default", "mirrored2"])
def test_a_compiled_gpt2_trains_as_the_eager_one(name):
    """The issue's GPT-2 through ``torch.compile`` (the first compile here costs most of this file's time; the
    second case reuses its graphs). Each Mirrored replica is an ``OptimizedModule`` around a copy of its own."""
    expected = tiny_gpt2()
    fit(trainer_for(name), expected)
    model = tiny_gpt2()
    compiled = torch.compile(model, backend=BACKEND)
    trainer = trainer_for(name)
    fit(trainer, compiled)
    assert largest_difference(model.state_dict(), expected.state_dict()) <= TOLERANCE  # the user's module trained
    replicas = trainer.model.replicas
    assert replicas[0] is compiled and all(type(r) is type(compiled) for r in replicas)
    weights = {r.get_parameter("_orig_mod.transformer.wte.weight").data_ptr() for r in replicas}
    assert len(weights) == len(replicas)  # a copy of its own for each replica (its forward calls its own copy)


def test_a_compiled_model_trains_as_the_eager_one_under_every_in_process_strategy(strategy):
    expected = TinyLM()
    fit(Trainer(strategy=strategy, optimizer=optimizers.SGD(0.2, momentum=0.5), loss=None, metrics=[]), expected)
    model = TinyLM()
    compiled = torch.compile(model, backend=BACKEND)
    fit(Trainer(strategy=strategy, optimizer=optimizers.SGD(0.2, momentum=0.5), loss=None, metrics=[]), compiled)
    assert largest_difference(model.state_dict(), expected.state_dict()) <= TOLERANCE


def test_a_compiled_models_backup_resumes_under_mirrored(tmp_path):
    expected = TinyLM()
    fit(trainer_for("mirrored2"), expected)
    backup = tmp_path / "backup"
    with pytest.raises(KeyboardInterrupt):
        compiled = torch.compile(TinyLM(), backend=BACKEND)
        fit(trainer_for("mirrored2"), compiled, [BackupAndRestore(backup, save_freq=2), InterruptAt(4)])
    model = TinyLM()
    fit(trainer_for("mirrored2"), torch.compile(model, backend=BACKEND), [BackupAndRestore(backup, save_freq=2)])
    assert largest_difference(model.state_dict(), expected.state_dict()) <= TOLERANCE


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["multi_worker", "fully_sharded"])
def test_a_compiled_model_on_two_workers_trains_as_eager_mirrored_two(strategy):
    expected = scenarios.worker_fit(0, None, None, model="tiny")
    kwargs = {"model": "compiled_tiny", "strategy": strategy}
    workers = results(run_workers(scenarios.__file__, "worker_fit", 2, timeout=150, kwargs=kwargs))
    for got in workers:
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-6)
        assert largest_difference(got["weights"], expected["weights"]) <= TOLERANCE
