"""The recipe strategy ``fully_sharded``: registered beside ``multi_worker_mirrored``, its keys one-to-one onto
``FullyShardedStrategy``'s arguments, checked by ``validate`` (a misspelt key, a wrong type, ``shard_units`` that
name no class of the model) with one message at the key.

Everything here runs in one process: with one worker nothing is sharded, so the strategy is built and trained
in-process (two workers: tests/cli/test_multi_worker_cli.py).
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import uuid

import pytest
import torch

import replicafit.strategies as ds
from replicafit import cli, recipes
from replicafit.recipes import builtins
from replicafit.recipes.registry import REGISTRIES, register_model

pytestmark = pytest.mark.timeout(120)

MARK = "#<"  # marks the line an error must point at

RECIPE = """
seed: 0
strategy:
  type: fully_sharded
  timeout_seconds: 300
  shard_units: [Linear]
  reshard_after_forward: false
  activation_checkpointing: true
data:
  type: classification
  n_samples: 64
  n_features: 4
  n_classes: 3
  validation_split: 0.25
model:
  type: mlp
  hidden: [8]
optimizer:
  type: sgd
  learning_rate: 0.1
loss: cross_entropy
metrics: [accuracy]
fit:
  epochs: 2
  batch_size: 16
  verbose: 0
"""


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """No cluster in the environment: the strategy is one worker (as `replicafit validate` sees it)."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def write(tmp_path, text: str, name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def marked_line(path) -> int:
    lines = [n for n, line in enumerate(path.read_text().splitlines(), start=1) if MARK in line]
    assert len(lines) == 1, f"the test recipe must mark exactly one line with {MARK}"
    return lines[0]


def assert_one_error_at(err: str, path, key: str, *fragments: str) -> None:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one message, got:\n{err}"
    assert re.match(rf"^error: {re.escape(str(path))}:{marked_line(path)}: {re.escape(key)}: ", lines[0]), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


def test_fully_sharded_is_registered_beside_multi_worker_mirrored(capsys):
    assert {"multi_worker_mirrored", "fully_sharded"} <= set(REGISTRIES["strategy"].names())
    assert REGISTRIES["strategy"].get("fully_sharded") is builtins.fully_sharded
    status, out, _ = run_cli(capsys, "list", "strategy")
    assert status == 0
    assert re.search(r"^\s+fully_sharded\s+FullyShardedStrategy: parameters, gradients and optimizer state", out, re.M)


def test_its_keys_are_the_constructor_arguments_one_to_one():
    """Every keyword of FullyShardedStrategy is a key; communication_options is given by its timeout_seconds (as
    multi_worker_mirrored gives it) and cluster_resolver by the environment."""
    keys = set(inspect.signature(builtins.fully_sharded).parameters)
    constructor = inspect.signature(ds.FullyShardedStrategy.__init__).parameters
    keyword_only = {name for name, p in constructor.items() if p.kind is p.KEYWORD_ONLY}
    assert keys == keyword_only | {"timeout_seconds"}
    for name in keyword_only:
        assert inspect.signature(builtins.fully_sharded).parameters[name].default == constructor[name].default, name


def test_validate_builds_the_strategy_with_the_recipe_arguments(tmp_path, monkeypatch, capsys):
    made = []

    class Recorded(ds.FullyShardedStrategy):
        def __init__(self, *args, **kwargs):
            made.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(ds, "FullyShardedStrategy", Recorded)
    path = write(tmp_path, RECIPE)
    checked = recipes.validate(recipes.load(path))
    strategy = checked["strategy_instance"]
    assert isinstance(strategy, Recorded) and len(made) == 1
    kwargs = made[0]
    assert kwargs["communication_options"].timeout_seconds == 300
    assert kwargs["shard_units"] == ["Linear"]
    assert kwargs["reshard_after_forward"] is False and kwargs["activation_checkpointing"] is True
    extended = strategy.extended
    assert (extended.shard_units, extended.reshard_after_forward, extended.activation_checkpointing) == (
        ["Linear"],
        False,
        True,
    )
    assert strategy.num_replicas_in_sync == 1 and not extended.sharded  # one worker: nothing is sharded
    status, out, err = run_cli(capsys, "validate", path)
    assert (status, err) == (0, "") and out.strip() == f"{path}: ok"


def test_a_plain_name_takes_the_constructor_defaults():
    strategy = builtins.fully_sharded()
    assert isinstance(strategy, ds.FullyShardedStrategy)
    extended = strategy.extended
    assert (extended.shard_units, extended.reshard_after_forward, extended.activation_checkpointing) == (
        None,
        True,
        False,
    )


def test_one_worker_fits_as_the_default_strategy_does(tmp_path, capsys):
    """`replicafit fit` in one process: one worker is the default strategy, bit for bit."""
    path = write(tmp_path, RECIPE)
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "sharded")
    assert status == 0, err
    assert "validation accuracy:" in out
    plain = write(tmp_path, re.sub(r"strategy:\n(  .*\n)+", "strategy: default\n", RECIPE), "plain.yaml")
    status, _, err = run_cli(capsys, "fit", plain, "--run-dir", tmp_path / "plain")
    assert status == 0, err

    def final(run):
        return json.loads((tmp_path / run / "metrics.json").read_text())["final"]

    assert final("sharded") == final("plain")
    ours = torch.load(tmp_path / "sharded" / "checkpoints" / "last.pt", weights_only=True)["model"]
    theirs = torch.load(tmp_path / "plain" / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key


BAD = [
    ("misspelt_key", "  shard_unit: [Linear]   #<", "strategy.shard_unit", ["did you mean 'shard_units'?"]),
    ("misspelt_timeout", "  timeout_second: 60   #<", "strategy.timeout_second", ["did you mean 'timeout_seconds'?"]),
    ("not_a_flag", "  reshard_after_forward: 1   #<", "strategy.reshard_after_forward", ["expected true or false"]),
    ("quoted_timeout", '  timeout_seconds: "60"   #<', "strategy.timeout_seconds", ["expected a number"]),
    ("a_name_not_a_list", "  shard_units: Linear   #<", "strategy.shard_units", ["expected a list"]),
    ("not_a_class_name", "  shard_units: [Linear, 3]   #<", "strategy.shard_units[1]", ["expected a string"]),
    (
        "no_such_class_in_the_model",
        "  shard_units: [GPT2Block]   #<",
        "strategy.shard_units",
        ["names no submodule of Sequential", "Linear, ReLU, Sequential"],
    ),
]


@pytest.mark.parametrize("line, key, fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_key_is_one_message_at_that_key(tmp_path, capsys, line, key, fragments):
    text = "model: {type: mlp, hidden: [8]}\ndata: digits\nstrategy:\n  type: fully_sharded\n" + line + "\n"
    path = write(tmp_path, text)
    status, out, err = run_cli(capsys, "validate", path)
    assert (status, out) == (2, "")
    assert_one_error_at(err, path, key, *fragments)


def test_shard_units_naming_no_class_of_a_users_model_fail_fit_before_training(tmp_path, capsys):
    """A user's model is not built by `validate`; `fit` checks the names once it is built, with one worker as with
    many (the strategy itself only looks with more than one, when it shards)."""
    name = f"blocks_{uuid.uuid4().hex[:10]}"

    @register_model(name, "a user's model")
    def blocks(inputs: int, outputs: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(inputs, 8), torch.nn.Tanh(), torch.nn.Linear(8, outputs))

    text = RECIPE.replace("type: mlp\n  hidden: [8]", f"type: {name}").replace(
        "shard_units: [Linear]", "shard_units: [Block]   #<"
    )
    path = write(tmp_path, text)
    status, _, err = run_cli(capsys, "validate", path)
    assert (status, err) == (0, "")  # the model is not built: nothing to check the names against
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert (status, out) == (2, "")
    classes = "(its module classes: Linear, Sequential, Tanh)"
    assert_one_error_at(err, path, "strategy.shard_units", "names no submodule of Sequential", classes)
    assert not (tmp_path / "run").exists()
    assert run_cli(capsys, "fit", path, "--set", "strategy.shard_units=[Tanh]", "--run-dir", tmp_path / "r")[0] == 0
