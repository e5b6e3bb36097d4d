"""Code a recipe names (recipes/kinds.py): `validate` never calls it, `fit` refuses what is not of the section's
kind, and a recipe's own dataset factory may return any form `fit` takes.

The contract: a recipe names code to run (``module:attr``), so it is trusted like a script; but only
``fit``/``evaluate``/``predict`` run it: ``validate`` imports it, checks that it is of the section's kind and
that the arguments bind, and constructs only replicafit's own built-ins.
"""

from __future__ import annotations

import functools
import os
import textwrap
import uuid

import numpy as np
import pytest
import torch

import replicafit.strategies as ds
from replicafit import cli, recipes
from replicafit.recipes import datasets, kinds
from replicafit.recipes.registry import register_dataset

USER_CODE = """
import os

import numpy as np
import torch
from torch import nn

import replicafit.strategies as ds
from replicafit.trainer.callbacks import Callback

CALLED = {called!r}  # each factory that runs leaves a file named after itself in this folder


def _called(name):
    open(os.path.join(CALLED, name), "w").close()


class MyStrategy(ds.OneDeviceStrategy):
    def __init__(self, device="cpu"):
        _called("MyStrategy")
        super().__init__(device)


def make_strategy(device: str = "cpu") -> ds.Strategy:
    _called("make_strategy")
    return ds.OneDeviceStrategy(device)


def unannotated_strategy(device="cpu"):
    _called("unannotated_strategy")
    return ds.OneDeviceStrategy(device)


def model(inputs, outputs, width: int = 8):
    _called("model")
    return nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, outputs))


def not_a_model(inputs, outputs):
    _called("not_a_model")
    return "a string"


def annotated_wrongly(inputs, outputs) -> int:
    _called("annotated_wrongly")
    return 3


def arrays(n: int = 64):
    _called("arrays")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 5)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def needs_a_path(path: str, n: int = 64):
    return arrays(n)


def tensor_dataset(n: int = 64):
    x, y = arrays(n)
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def loader(n: int = 64, batch: int = 16):
    return torch.utils.data.DataLoader(tensor_dataset(n), batch_size=batch)


class Unlabelled(torch.utils.data.Dataset):  # labels made per example: nothing tells the classes without a scan
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.zeros(5), index % 2


def opaque_loader(batch: int = 16):
    return torch.utils.data.DataLoader(Unlabelled(), batch_size=batch)


def split(n: int = 64):
    x, y = arrays(n)
    return {{"train": (x[:48], y[:48]), "validation": (x[48:], y[48:])}}


def bad_train():
    return {{"train": "not data"}}


def nothing():
    _called("nothing")
    return "nope"


class Marker(Callback):
    def __init__(self, label: str = "x"):
        _called("Marker")
        super().__init__()
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    """``(module name, folder of the factories that ran)``; the current directory is tmp_path."""
    called = tmp_path / "called"
    called.mkdir()
    name = f"rf_user_code_{uuid.uuid4().hex[:10]}"
    (tmp_path / f"{name}.py").write_text(USER_CODE.format(called=str(called)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return name, called


def ran(called) -> list:
    return sorted(os.listdir(called))


def write(tmp_path, text: str, name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def one_error(capsys, *argv) -> str:
    status, out, err = run_cli(capsys, *argv)
    assert "Traceback" not in err
    assert (status, out) == (2, ""), err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


QUIET_FIT = "fit:\n  epochs: 1\n  verbose: 0\n"


# --- validate never calls code outside replicafit (item 7) ------------------------------------------
@pytest.mark.parametrize(
    "section,entry,expected",
    [
        ("strategy", "{type: 'os:system', command: 'touch CANARY'}", "replicafit.strategies.Strategy subclass"),
        ("strategy", "{type: 'subprocess:Popen', args: [touch, CANARY]}", "it is the class subprocess.Popen"),
        ("strategy", "{type: 'subprocess:run', args: [touch, CANARY]}", "without a return annotation"),
        ("model", "{type: 'builtins:exec', source: 'open(\"CANARY\", \"w\")'}", "torch.nn.Module subclass"),
        ("data", "{type: 'os:system', command: 'touch CANARY'}", "a torch Dataset or DataLoader class"),
        ("optimizer", "{type: 'os:system', command: 'touch CANARY'}", "replicafit.optimizers.Optimizer subclass"),
        ("loss", "{type: 'builtins:eval', source: '__import__(\"os\").system(\"touch CANARY\")'}", "callable loss"),
        ("callbacks", "[{type: 'subprocess:call', args: [touch, CANARY]}]", "Callback subclass"),
        ("metrics", "[{type: 'os:system', command: 'touch CANARY'}]", "Metric subclass"),
    ],
)
@pytest.mark.parametrize("command", ["validate", "fit"])
def test_code_of_the_wrong_kind_is_refused_and_never_called(
    tmp_path, capsys, monkeypatch, section, entry, expected, command
):
    monkeypatch.chdir(tmp_path)
    text = {"model": "model: mlp\n", "data": "data: digits\n"}
    text[section] = f"{section}: {entry}\n"
    path = write(tmp_path, "".join(text.values()) + QUIET_FIT)
    argv = [command, path] + (["--run-dir", tmp_path / "run"] if command == "fit" else [])
    line = one_error(capsys, *argv)
    assert line.startswith(f"error: {path}:") and " is not a" in line and expected in line, line
    assert not (tmp_path / "CANARY").exists()
    assert not (tmp_path / "run").exists()


def test_the_message_names_the_expected_kind(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "model: mlp\ndata: digits\nstrategy:\n  type: 'os:system'\n  command: 'touch CANARY'\n")
    assert one_error(capsys, "validate", path) == (
        f"error: {path}:4: strategy.type: 'os:system' is not a strategy (expected a replicafit.strategies.Strategy "
        "subclass, or a function annotated to return one): it is a built-in function, which is not a factory of "
        "anything a recipe builds"
    )


def test_validate_imports_user_code_but_calls_none_of_it(tmp_path, capsys, user):
    module, called = user
    path = write(
        tmp_path,
        f"""
        seed: 0
        strategy: {{type: "{module}:MyStrategy", device: cpu}}
        data: {{type: "{module}:arrays", n: 64}}
        model: {{type: "{module}:model", width: 4}}
        callbacks: [{{type: "{module}:Marker", label: hello}}]
        fit: {{epochs: 1, batch_size: 16, verbose: 0}}
        """,
    )
    status, out, err = run_cli(capsys, "validate", path)
    assert (status, err) == (0, ""), err
    assert ran(called) == []
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert ran(called) == ["Marker", "MyStrategy", "arrays", "model"]


def test_validate_does_not_call_a_registered_user_dataset(tmp_path):
    name, calls = f"user_blobs_{uuid.uuid4().hex[:10]}", []

    @register_dataset(name)
    def blobs(n: int = 32):
        calls.append(n)
        x = np.zeros((n, 3), np.float32)
        return {"train": (x, np.zeros(n, np.int64)), "inputs": 3, "classes": 2}

    path = write(tmp_path, f"model: mlp\ndata: {{type: {name}, n: 32}}\n")
    recipes.validate(recipes.load(path))
    assert calls == []
    recipes.build(recipes.load(path))
    assert calls == [32]


def test_validate_still_checks_the_arguments_of_user_code(tmp_path, capsys, user):
    module, called = user
    path = write(tmp_path, f'model: mlp\ndata: digits\nstrategy: {{type: "{module}:MyStrategy", devise: cpu}}\n')
    assert "strategy.devise: unknown argument" in one_error(capsys, "validate", path)
    assert "did you mean 'device'?" in one_error(capsys, "validate", path)
    path = write(tmp_path, f'model: mlp\ndata: {{type: "{module}:needs_a_path"}}\n')
    assert "data: missing required argument 'path'" in one_error(capsys, "validate", path)
    path = write(tmp_path, f'model: {{type: "{module}:model", widht: 3}}\ndata: digits\n')
    assert "model.widht: unknown argument" in one_error(capsys, "validate", path)
    path = write(tmp_path, f'model: {{type: "{module}:model", width: wide}}\ndata: digits\n')
    assert "model.width: expected a number, got the string 'wide'" in one_error(capsys, "validate", path)
    assert ran(called) == []


def test_a_strategy_function_must_say_it_returns_a_strategy(tmp_path, capsys, user):
    module, called = user
    path = write(tmp_path, f'model: mlp\ndata: digits\nstrategy: "{module}:unannotated_strategy"\n' + QUIET_FIT)
    line = one_error(capsys, "validate", path)
    assert "is not a strategy" in line and "without a return annotation" in line
    path = write(tmp_path, f'model: mlp\ndata: digits\nstrategy: "{module}:make_strategy"\n' + QUIET_FIT)
    assert run_cli(capsys, "validate", path)[0] == 0
    assert ran(called) == []
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert ran(called) == ["make_strategy"]


def test_an_annotation_that_disagrees_is_refused(tmp_path, capsys, user):
    module, called = user
    path = write(tmp_path, f'model: "{module}:annotated_wrongly"\ndata: digits\n')
    assert "is annotated to return int, not a model" in one_error(capsys, "validate", path)
    assert ran(called) == []


@pytest.mark.parametrize(
    "model,data,fragment",
    [
        ("not_a_model", "arrays", "model: '{m}:not_a_model' returned the str 'a string', not a model"),
        ("model", "nothing", "data: '{m}:nothing' returned the str 'nope', not a dataset"),
        ("model", "bad_train", "data: '{m}:bad_train' returned a dict whose 'train' entry is the str 'not data'"),
    ],
)
def test_fit_refuses_what_a_factory_returns_unless_it_is_of_the_kind(tmp_path, capsys, user, model, data, fragment):
    module, called = user
    path = write(tmp_path, f'model: "{module}:{model}"\ndata: "{module}:{data}"\n' + QUIET_FIT)
    assert run_cli(capsys, "validate", path)[0] == 0
    line = one_error(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert fragment.format(m=module) in line, line


# --- a recipe's own dataset factory may return what fit takes (item 8) --------------------------------
def test_dataset_factory_returning_arrays(tmp_path, capsys, user):
    module, _ = user
    path = write(tmp_path, f'seed: 0\nmodel: mlp\ndata: "{module}:arrays"\nmetrics: [accuracy]\n' + QUIET_FIT)
    run = recipes.build(recipes.load(path))
    assert run.train[0].shape == (64, 5) and run.validation is None
    assert (run.model[0].in_features, run.model[-1].out_features) == (5, 2)  # inputs and classes read from the arrays
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert "accuracy" in out


def test_dataset_factory_returning_a_torch_dataset(tmp_path, capsys, user):
    module, _ = user
    text = f'seed: 0\nmodel: {{type: mlp, outputs: 2}}\ndata: {{type: "{module}:tensor_dataset", batch_size: 16}}\n'
    path = write(tmp_path, text + QUIET_FIT)
    run = recipes.build(recipes.load(path))
    assert isinstance(run.train, torch.utils.data.TensorDataset) and run.model[0].in_features == 5
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err


def test_dataset_factory_returning_a_torch_dataset_needs_a_batch_size(tmp_path, capsys, user):
    module, _ = user
    path = write(tmp_path, f'model: {{type: mlp, outputs: 2}}\ndata: "{module}:tensor_dataset"\n' + QUIET_FIT)
    assert "set data.batch_size (or fit.batch_size)" in one_error(capsys, "fit", path, "--run-dir", tmp_path / "run")


def test_dataset_factory_returning_a_dataloader(tmp_path, capsys, user):
    module, _ = user
    path = write(tmp_path, f'seed: 0\nmodel: {{type: mlp, outputs: 2}}\ndata: "{module}:loader"\n' + QUIET_FIT)
    run = recipes.build(recipes.load(path))
    assert isinstance(run.train, torch.utils.data.DataLoader)
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    history = (tmp_path / "run" / "history.csv").read_text().splitlines()
    assert len(history) == 2  # a header and one epoch


def test_dataset_factory_returning_a_dataloader_refuses_batch_size_and_validation_split(tmp_path, capsys, user):
    module, _ = user
    text = f'model: {{type: mlp, outputs: 2}}\ndata: {{type: "{module}:loader", batch_size: 8}}\n' + QUIET_FIT
    line = one_error(capsys, "fit", write(tmp_path, text), "--run-dir", tmp_path / "run")
    assert "data.batch_size:" in line and "gives batches already" in line
    text = f'model: {{type: mlp, outputs: 2}}\ndata: "{module}:loader"\nfit: {{validation_split: 0.2, verbose: 0}}\n'
    line = one_error(capsys, "fit", write(tmp_path, text), "--run-dir", tmp_path / "run")
    assert "fit.validation_split: validation_split needs arrays or a torch Dataset" in line


def test_a_model_size_the_data_cannot_tell(tmp_path, capsys, user):
    module, _ = user
    path = write(tmp_path, f'model: mlp\ndata: "{module}:opaque_loader"\n' + QUIET_FIT)
    line = one_error(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert "model: the model needs 'outputs'" in line and "write `outputs: N` in the model section" in line
    assert "`targets` attribute" in line  # how a Dataset tells it


def test_dataset_factory_returning_the_dict_form_with_validation(tmp_path, capsys, user):
    module, _ = user
    path = write(tmp_path, f'seed: 0\nmodel: mlp\ndata: "{module}:split"\nmetrics: [accuracy]\n' + QUIET_FIT)
    run = recipes.build(recipes.load(path))
    assert run.fit_kwargs["validation_data"][0].shape == (16, 5)
    assert (run.model[0].in_features, run.model[-1].out_features) == (5, 2)
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0 and "validation accuracy:" in out, err


def test_as_info_forms():
    x, y = np.zeros((6, 2, 3), np.float32), np.array([0, 1, 2, 0, 1, 2])
    assert datasets.as_info((x, y)) == {"inputs": 6, "classes": 3, "train": (x, y), "validation": None}
    regression = (x, np.zeros((6, 1), np.float32))
    assert datasets.as_info(regression)["inputs"] == 6 and "classes" not in datasets.as_info(regression)
    mine = {"train": (x, y), "inputs": 99}
    assert datasets.as_info(mine)["inputs"] == 99  # what the factory says wins over what is read
    batches = [(torch.zeros(2, 3), torch.zeros(2))]
    assert datasets.as_info(batches) == {"train": batches, "validation": None}
    for bad in ("text", 3, None, {"x": 1}, {"validation": (x, y)}):
        with pytest.raises(ValueError, match="not a dataset"):
            datasets.as_info(bad)


# --- the kinds, directly ----------------------------------------------------------------------------
def annotated() -> ds.Strategy:
    return ds.OneDeviceStrategy("cpu")


def plain():
    return None


class Holder:
    @classmethod
    def build(cls) -> ds.Strategy:
        return ds.OneDeviceStrategy("cpu")


@pytest.mark.parametrize(
    "section,factory,fragment",
    [
        ("strategy", ds.MirroredStrategy, None),
        ("strategy", annotated, None),
        ("strategy", Holder.build, None),
        ("strategy", functools.partial(annotated), None),
        ("strategy", plain, "without a return annotation"),
        ("strategy", os.system, "built-in function"),
        ("strategy", torch.nn.Linear, "it is the class torch.nn.modules.linear.Linear, not a strategy"),
        ("model", torch.nn.Linear, None),
        ("model", plain, None),
        ("model", eval, "built-in function"),
        ("model", ds.MirroredStrategy, "not a model"),
        ("model", annotated, "annotated to return replicafit.strategies.distribute_lib.Strategy, not a model"),
        ("dataset", torch.utils.data.TensorDataset, None),
        ("dataset", datasets.digits, None),
        ("dataset", 42, "it is an int object"),
        ("loss", torch.nn.CrossEntropyLoss, None),
        ("callback", plain, "without a return annotation"),
    ],
)
def test_factory_problem(section, factory, fragment):
    problem = kinds.factory_problem(section, factory)
    if fragment is None:
        assert problem is None
    else:
        assert fragment in (problem or ""), problem


def test_only_replicafits_own_builtins_count_as_builtin():
    from replicafit.recipes import builtins, models

    assert kinds.is_builtin("strategy", builtins.mirrored) and kinds.is_builtin("strategy", ds.MirroredStrategy)
    assert kinds.is_builtin("model", models.mlp) and kinds.is_builtin("dataset", datasets.digits)
    assert not kinds.is_builtin("dataset", cli.main)  # replicafit's, but not a dataset factory: never called
    assert not kinds.is_builtin("model", plain)
