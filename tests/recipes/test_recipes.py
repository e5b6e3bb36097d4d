"""YAML recipes: loading, validation errors, --set, ${VAR}, registries.

A bad recipe gets one message ``file:line: key.path: problem`` (a did-you-mean for a misspelt
key or name), exit status 2 and no traceback. Most tests call ``replicafit.cli.main`` directly;
test_cli.py runs the command end to end.
"""

from __future__ import annotations

import pathlib
import re
import sys
import textwrap
import uuid

import numpy as np
import pytest
import torch

from replicafit import cli, recipes
from replicafit.recipes import models as builtin_models
from replicafit.recipes.registry import REGISTRIES, register_dataset, register_model

MARK = "#<"  # marks the line an error must point at


# --- helpers ---------------------------------------------------------------------------------
def write(tmp_path, text: str, name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def marked_line(path) -> int:
    lines = [n for n, line in enumerate(path.read_text().splitlines(), start=1) if MARK in line]
    assert len(lines) == 1, f"the test recipe must mark exactly one line with {MARK}"
    return lines[0]


def run_cli(capsys, *argv):
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def line_of(path, text: str) -> int:
    """The 1-based number of the first line of the file at ``path`` containing ``text``."""
    for number, line in enumerate(open(path).read().splitlines(), start=1):
        if text in line:
            return number
    raise AssertionError(f"{text!r} not in {path}")


def assert_recipe_error(err: str, path, line, key: str, *fragments: str) -> str:
    """One line ``error: file:line: key: message``; returns the message."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one message, got:\n{err}"
    location = re.escape(str(path)) + (f":{line}" if line is not None else "")
    prefix = f"{location}: {re.escape(key)}: " if key else f"{location}: "
    match = re.match(rf"^error: {prefix}(?P<message>.+)$", lines[0])
    assert match, f"expected 'error: {path}:{line}: {key}: ...', got {lines[0]!r}"
    for fragment in fragments:
        assert fragment in match.group("message"), f"{fragment!r} not in {lines[0]!r}"
    return match.group("message")


CLASSIFICATION = """
seed: 0
strategy: one_device
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
  epochs: 1
  batch_size: 16
  verbose: 0
"""


# --- malformed recipes: (id, recipe text with the bad line marked, key path, message fragments) --
MALFORMED = [
    (
        "auto_shard_policy_unknown",
        """
        model: mlp
        data:
          type: digits
          auto_shard_policy: files   #<
        """,
        "data.auto_shard_policy",
        ["expected one of AUTO, FILE, DATA, OFF", "did you mean 'FILE'?"],
    ),
    (
        "sync_batchnorm_not_a_flag",
        """
        model:
          type: mlp
          batch_norm: true
          sync_batchnorm: yes please   #<
        data: digits
        """,
        "model.sync_batchnorm",
        ["expected true or false, got str 'yes please'"],
    ),
    (
        "sync_batchnorm_without_batchnorm",
        """
        model:
          type: cnn
          sync_batchnorm: true   #<
        data: {type: digits, images: true}
        """,
        "model.sync_batchnorm",
        ["no BatchNorm layer to synchronize", "`batch_norm: true`"],
    ),
    (
        "unknown_section",
        """
        model: mlp
        data: digits
        optimiser: adam   #<
        """,
        "optimiser",
        ["unknown section", "did you mean 'optimizer'?"],
    ),
    (
        "unknown_section_metric",
        """
        model: mlp
        data: digits
        metric: [accuracy]   #<
        """,
        "metric",
        ["did you mean 'metrics'?"],
    ),
    (
        "unknown_optimizer_argument",
        """
        model: mlp
        data: digits
        optimizer:
          type: sgd
          learning_rat: 0.1   #<
        """,
        "optimizer.learning_rat",
        ["unknown argument", "did you mean 'learning_rate'?"],
    ),
    (
        "unknown_optimizer_name",
        """
        model: mlp
        data: digits
        optimizer:
          type: adamm   #<
          learning_rate: 0.01
        """,
        "optimizer.type",
        ["adamm", "did you mean 'adam'?"],
    ),
    (
        "unknown_optimizer_plain_name",
        """
        model: mlp
        data: digits
        optimizer: adamm   #<
        """,
        "optimizer",
        ["did you mean 'adam'?"],
    ),
    (
        "unknown_model_name",
        """
        data: digits
        model:
          type: mpl   #<
          hidden: [8]
        """,
        "model.type",
        ["mpl", "did you mean 'mlp'?"],
    ),
    (
        "unknown_dataset_name",
        """
        model: mlp
        data:
          type: digit   #<
          validation_split: 0.2
        """,
        "data.type",
        ["did you mean 'digits'?"],
    ),
    (
        "unknown_metric_name",
        """
        model: mlp
        data: digits
        metrics:
          - accuracy
          - sparse_categorical_acuracy   #<
        """,
        "metrics[1]",
        ["did you mean 'sparse_categorical_accuracy'?"],
    ),
    (
        "unknown_callback_name",
        """
        model: mlp
        data: digits
        callbacks:
          - type: early_stoping   #<
            patience: 2
        """,
        "callbacks[0].type",
        ["did you mean 'early_stopping'?"],
    ),
    (
        "unknown_callback_argument",
        """
        model: mlp
        data: digits
        callbacks:
          - type: early_stopping
            patiense: 2   #<
        """,
        "callbacks[0].patiense",
        ["unknown argument", "did you mean 'patience'?"],
    ),
    (
        "unknown_loss_name",
        """
        model: mlp
        data: digits
        loss: cross_entropi   #<
        """,
        "loss",
        ["did you mean 'cross_entropy'?"],
    ),
    (
        "unknown_schedule_name",
        """
        model: mlp
        data: digits
        optimizer:
          type: sgd
          learning_rate:
            type: cosine_decy   #<
            initial_learning_rate: 0.1
            decay_steps: 10
        """,
        "optimizer.learning_rate.type",
        ["did you mean 'cosine_decay'?"],
    ),
    (
        "unknown_model_argument",
        """
        data: digits
        model:
          type: mlp
          hiden: [8]   #<
        """,
        "model.hiden",
        ["did you mean 'hidden'?"],
    ),
    (
        "unknown_strategy_argument",
        """
        model: mlp
        data: digits
        strategy:
          type: mirrored
          device: [cpu:0, cpu:1]   #<
        """,
        "strategy.device",
        ["did you mean 'devices'?"],
    ),
    (
        "quoted_number",
        """
        model: mlp
        data: digits
        optimizer:
          type: adam
          learning_rate: "0.001"   #<
        """,
        "optimizer.learning_rate",
        ["expected a number", "'0.001'"],
    ),
    (
        "bool_for_int_fit",
        """
        model: mlp
        data: digits
        fit:
          epochs: true   #<
        """,
        "fit.epochs",
        ["boolean"],
    ),
    (
        "bool_for_int_dataset_argument",
        """
        model: mlp
        data:
          type: classification
          n_samples: yes   #<
        """,
        "data.n_samples",
        ["boolean"],
    ),
    (
        "list_for_scalar",
        """
        model: mlp
        data: digits
        optimizer:
          type: sgd
          learning_rate: [0.1]   #<
        """,
        "optimizer.learning_rate",
        ["expected a number"],
    ),
    (
        "scalar_for_list",
        """
        data: digits
        model:
          type: mlp
          hidden: 32   #<
        """,
        "model.hidden",
        ["expected a list"],
    ),
    (
        "string_for_device_list",
        """
        model: mlp
        data: digits
        strategy:
          type: mirrored
          devices: cpu:0   #<
        """,
        "strategy.devices",
        ["expected a list"],
    ),
    (
        "missing_type",
        """
        data: digits
        model:   #<
          hidden: [8]
        """,
        "model",
        ["missing 'type'"],
    ),
    (
        "missing_type_in_list_entry",
        """
        model: mlp
        data: digits
        callbacks:
          - monitor: val_loss   #<
            patience: 2
        """,
        "callbacks[0]",
        ["missing 'type'"],
    ),
    (
        "type_not_a_string",
        """
        data: digits
        model:
          type: 3   #<
        """,
        "model.type",
        ["expected a string"],
    ),
    (
        "entry_neither_name_nor_mapping",
        """
        model: mlp
        data: digits
        optimizer: 3   #<
        """,
        "optimizer",
        ["mapping with 'type'"],
    ),
    (
        "missing_required_argument_npz",
        """
        model: mlp
        data:   #<
          type: npz
          features: x
        """,
        "data",
        ["missing required argument 'path'", "'npz'"],
    ),
    (
        "missing_required_argument_csv",
        """
        model: mlp
        data:   #<
          type: csv
          path: table.csv
        """,
        "data",
        ["missing required argument 'label'"],
    ),
    (
        "unknown_fit_key",
        """
        model: mlp
        data: digits
        fit:
          epoch: 3   #<
        """,
        "fit.epoch",
        ["did you mean 'epochs'?"],
    ),
    (
        "unknown_evaluate_key",
        """
        model: mlp
        data: digits
        evaluate:
          batch: 3   #<
        """,
        "evaluate.batch",
        ["did you mean 'batch_size'?"],
    ),
    (
        "fit_epochs_zero",
        """
        model: mlp
        data: digits
        fit:
          epochs: 0   #<
        """,
        "fit.epochs",
        ["positive"],
    ),
    (
        "fit_validation_split_too_large",
        """
        model: mlp
        data: digits
        fit:
          validation_split: 1.5   #<
        """,
        "fit.validation_split",
        ["[0, 1)", "1.5"],
    ),
    (
        "fit_verbose_3",
        """
        model: mlp
        data: digits
        fit:
          verbose: 3   #<
        """,
        "fit.verbose",
        ["'auto'", "3"],
    ),
    (
        "fit_verbose_bool",
        """
        model: mlp
        data: digits
        fit:
          verbose: true   #<
        """,
        "fit.verbose",
        ["'auto'"],
    ),
    (
        "fit_not_a_mapping",
        """
        model: mlp
        data: digits
        fit: 5   #<
        """,
        "fit",
        ["expected a mapping"],
    ),
    (
        "batch_size_twice",
        """
        model: mlp
        data:
          type: digits
          batch_size: 32
        fit:
          batch_size: 64   #<
        """,
        "fit.batch_size",
        ["data"],
    ),
    (
        "data_batch_size_zero",
        """
        model: mlp
        data:
          type: digits
          batch_size: 0   #<
        """,
        "data.batch_size",
        ["positive"],
    ),
    (
        "seed_not_an_integer",
        """
        seed: abc   #<
        model: mlp
        data: digits
        """,
        "seed",
        ["expected an integer"],
    ),
    (
        "cuda_device_on_cpu_machine",
        """
        model: mlp
        data: digits
        strategy:
          type: mirrored
          devices: ["cuda:0"]   #<
        """,
        "strategy.devices",
        ["cuda:0"],
    ),
    (
        "cuda_one_device_on_cpu_machine",
        """
        model: mlp
        data: digits
        strategy:
          type: one_device
          device: cuda:0   #<
        """,
        "strategy.device",
        ["cuda:0"],
    ),
    (
        "cuda_parameter_device_on_cpu_machine",
        """
        model: mlp
        data: digits
        strategy:
          type: central_storage
          compute_devices: ["cpu:0", "cpu:1"]
          parameter_device: cuda:0   #<
        """,
        "strategy.parameter_device",
        ["cuda:0"],
    ),
    (
        "regression_metric_on_classification",
        """
        model: mlp
        data: digits
        metrics:
          - accuracy
          - mse   #<
        """,
        "metrics[1]",
        ["'mse'", "classification"],
    ),
    (
        "accuracy_on_regression",
        """
        model: linear
        data: regression
        loss: mse
        metrics: [accuracy]   #<
        """,
        "metrics[0]",
        ["'accuracy'", "regression"],
    ),
    (
        "regression_loss_on_classification",
        """
        model: mlp
        data: digits
        loss: mse   #<
        """,
        "loss",
        ["'mse'", "classification"],
    ),
    (
        "classification_loss_on_regression",
        """
        model: linear
        data:
          type: regression
          n_samples: 100
        loss:   #<
          type: cross_entropy
        """,
        "loss",
        ["'cross_entropy'", "regression"],
    ),
    (
        "missing_module",
        """
        data: digits
        model:
          type: "no_such_module_for_replicafit_tests:make"   #<
        """,
        "model.type",
        ["cannot import", "no_such_module_for_replicafit_tests"],
    ),
    (
        "missing_attribute",
        """
        data: digits
        model:
          type: "json:no_such_factory"   #<
        """,
        "model.type",
        ["cannot import", "no_such_factory"],
    ),
    (
        "metrics_not_a_list",
        """
        model: mlp
        data: digits
        metrics: accuracy   #<
        """,
        "metrics",
        ["expected a list"],
    ),
    (
        "callbacks_not_a_list",
        """
        model: mlp
        data: digits
        callbacks:   #<
          type: early_stopping
        """,
        "callbacks",
        ["expected a list"],
    ),
    # --- values that used to pass validate and crash later with a traceback (hardening items 5 and 6)
    (
        "seed_beyond_torch_range",
        """
        seed: 1000000000000000000000000000000   #<
        model: mlp
        data: digits
        """,
        "seed",
        ["2**64 - 1", "torch.manual_seed"],
    ),
    (
        "seed_negative",
        """
        seed: -1   #<
        model: mlp
        data: digits
        """,
        "seed",
        ["2**64 - 1"],
    ),
    (
        "relative_module_type",
        """
        data: digits
        model:
          type: ".foo:bar"   #<
        """,
        "model.type",
        ["relative module names are not allowed", "package.module:attr"],
    ),
    (
        "mlp_negative_hidden_size",
        """
        data: digits
        model:
          type: mlp
          hidden: [-4]   #<
        """,
        "model.hidden[0]",
        ["positive integer", "-4"],
    ),
    (
        "mlp_zero_hidden_size",
        """
        data: digits
        model:
          type: mlp
          hidden:
            - 16
            - 0   #<
        """,
        "model.hidden[1]",
        ["positive integer", "0"],
    ),
    (
        "mlp_hidden_size_not_a_number",
        """
        data: digits
        model:
          type: mlp
          hidden:
            - 16
            - wide   #<
        """,
        "model.hidden[1]",
        ["expected a number", "'wide'"],
    ),
    (
        "mlp_hidden_size_boolean",
        """
        data: digits
        model:
          type: mlp
          hidden:
            - true   #<
        """,
        "model.hidden[0]",
        ["boolean"],
    ),
    (
        "mlp_hidden_size_nested_list",
        """
        data: digits
        model:
          type: mlp
          hidden:
            - [8]   #<
        """,
        "model.hidden[0]",
        ["expected an integer"],
    ),
    (
        "cnn_zero_channels",
        """
        data: {type: digits, images: true}
        model:
          type: cnn
          channels:
            - 16
            - 0   #<
        """,
        "model.channels[1]",
        ["positive integer"],
    ),
    (
        "cnn_image_size_zero",
        """
        data: {type: digits, images: true}
        model:
          type: cnn
          image_size: 0   #<
        """,
        "model.image_size",
        ["positive integer"],
    ),
    (
        "linear_negative_outputs",
        """
        data: regression
        loss: mse
        model:
          type: linear
          outputs: -1   #<
        """,
        "model.outputs",
        ["positive integer"],
    ),
    (
        "mlp_unknown_activation_caught_by_validate",
        """
        data: digits
        model:
          type: mlp
          activation: relux   #<
        """,
        "model.activation",
        ["unknown activation"],
    ),
    (
        "mirrored_empty_devices",
        """
        model: mlp
        data: digits
        strategy:
          type: mirrored
          devices: []   #<
        """,
        "strategy.devices",
        ["empty list", "leave devices out"],
    ),
    (
        "central_storage_empty_compute_devices",
        """
        model: mlp
        data: digits
        strategy:
          type: central_storage
          compute_devices: []   #<
        """,
        "strategy.compute_devices",
        ["empty list"],
    ),
    (
        "learning_rate_infinite",
        """
        model: mlp
        data: digits
        optimizer:
          type: sgd
          learning_rate: .inf   #<
        """,
        "optimizer.learning_rate",
        ["finite number >= 0", "inf"],
    ),
    (
        "learning_rate_nan",
        """
        model: mlp
        data: digits
        optimizer:
          type: adam
          learning_rate: .nan   #<
        """,
        "optimizer.learning_rate",
        ["NaN"],
    ),
    (
        "learning_rate_negative",
        """
        model: mlp
        data: digits
        optimizer:
          type: sgd
          learning_rate: -0.1   #<
        """,
        "optimizer.learning_rate",
        ["finite number >= 0", "-0.1"],
    ),
    (
        "schedule_learning_rate_nan",
        """
        model: mlp
        data: digits
        optimizer:
          type: sgd
          learning_rate:
            type: cosine_decay
            initial_learning_rate: .nan   #<
            decay_steps: 10
        """,
        "optimizer.learning_rate.initial_learning_rate",
        ["NaN"],
    ),
    (
        "nan_for_any_number",
        """
        model: mlp
        data:
          type: classification
          noise: .nan   #<
        """,
        "data.noise",
        ["NaN"],
    ),
]


@pytest.mark.parametrize("text,key,fragments", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_recipe(tmp_path, capsys, text, key, fragments):
    path = write(tmp_path, text)
    status, out, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert out == ""
    assert_recipe_error(err, path, marked_line(path), key, *fragments)


def test_malformed_recipe_fails_fit_too_before_anything_runs(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION.replace("learning_rate: 0.1", "learning_rat: 0.1   #<"))
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "optimizer.learning_rat", "did you mean 'learning_rate'?")
    assert not (tmp_path / "run").exists()


def test_recipe_error_exception_shape(tmp_path):
    path = write(tmp_path, CLASSIFICATION.replace("epochs: 1", "epochs: 0   #<"))
    with pytest.raises(recipes.RecipeError) as caught:
        recipes.validate(recipes.load(path))
    error = caught.value
    assert (error.file, error.line, error.key) == (str(path), marked_line(path), "fit.epochs")
    assert str(error).startswith(f"{path}:{marked_line(path)}: fit.epochs: ")


@pytest.mark.parametrize("missing", ["model", "data"])
def test_missing_section(tmp_path, capsys, missing):
    text = "model:\n  type: mlp\n" if missing == "data" else "data:\n  type: digits\n"
    path = write(tmp_path, "seed: 0\n" + text)
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert "Traceback" not in err
    assert re.match(rf"^error: {re.escape(str(path))}(:\d+)?: .*missing section '{missing}'", err.strip()), err


def test_yaml_syntax_error_reports_line_and_column(tmp_path, capsys):
    path = write(
        tmp_path,
        """
        data: digits
        model:
          type: mlp
           hidden: [8]
        """,
    )
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert "Traceback" not in err
    # the ':' after 'hidden' on line 4: 3 spaces + 'hidden' -> column 10
    assert re.match(rf"^error: {re.escape(str(path))}:4:10: YAML syntax error: ", err.strip()), err
    assert len(err.strip().splitlines()) == 1


def test_yaml_syntax_error_unclosed_bracket(tmp_path, capsys):
    path = write(tmp_path, 'data: digits\nmodel:\n  type: mlp\n  hidden: [8, 16\nloss: "cross_entropy"\n')
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert "Traceback" not in err
    match = re.match(rf"^error: {re.escape(str(path))}:(\d+):(\d+): YAML syntax error: ", err.strip())
    assert match, err
    assert 4 <= int(match.group(1)) <= 5


def test_recipe_that_is_a_list(tmp_path, capsys):
    path = write(tmp_path, "- model: mlp\n- data: digits\n")
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert_recipe_error(err, path, 1, "", "a recipe is a mapping", "not a list")


def test_missing_recipe_file(tmp_path, capsys):
    path = tmp_path / "nope.yaml"
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert "Traceback" not in err
    assert err.startswith(f"error: {path}: ") and "cannot read" in err


def test_empty_recipe_misses_its_sections(tmp_path, capsys):
    path = write(tmp_path, "# nothing here\n")
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert "missing section 'model'" in err and "Traceback" not in err


def test_dataset_argument_out_of_range_is_caught_by_validate(tmp_path, capsys):
    """`validate` checks everything that can be checked without training: fit must not be the first to
    notice that the data section cannot be built."""
    path = write(
        tmp_path,
        """
        model: mlp
        data:
          type: digits
          validation_split: 1.5   #<
        """,
    )
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2
    assert "Traceback" not in err and "validation_split" in err
    status, out, err = run_cli(capsys, "validate", path)
    assert status == 2, f"validate accepted a recipe that fit rejects: {out}"
    assert "validation_split" in err


@pytest.mark.parametrize(
    "entry, problem",
    [
        ("{type: backup_and_restore, backup_dir: b, save_freq: 0}", "callbacks[0].save_freq: save_freq must be"),
        (
            "{type: backup_and_restore, backup_dir: b, save_before_preemption: [SIGTERM, SIGKILL]}",
            "callbacks[0].save_before_preemption: save_before_preemption cannot catch SIGKILL",
        ),
        ("{type: early_stopping, mode: most}", "callbacks[0]"),
    ],
)
def test_built_in_callbacks_with_bad_values_are_caught_by_validate(tmp_path, capsys, entry, problem):
    """Regression: validate said ok, and fit was the first to notice."""
    path = write(tmp_path, CLASSIFICATION)
    status, out, err = run_cli(capsys, "validate", path, "--set", f"callbacks=[{entry}]")
    assert status == 2, out
    assert problem in err and "Traceback" not in err


def test_save_before_preemption_takes_a_boolean_or_signal_names_in_a_recipe(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION)
    for value in ("true", "SIGUSR1", "[SIGTERM, USR1]"):
        entry = f"callbacks=[{{type: backup_and_restore, backup_dir: b, save_before_preemption: {value}}}]"
        status, _, err = run_cli(capsys, "validate", path, "--set", entry)
        assert (status, err) == (0, ""), value


def test_the_largest_seed_torch_takes_runs(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION.replace("seed: 0", f"seed: {2**64 - 1}"))
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err


def test_valid_recipe_validates(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION)
    status, out, err = run_cli(capsys, "validate", path)
    assert (status, err) == (0, "")
    assert out.strip() == f"{path}: ok"


# --- --set overrides --------------------------------------------------------------------------
def test_set_scalar_and_list_values(tmp_path):
    path = write(tmp_path, CLASSIFICATION)
    recipe = recipes.load(path, ["fit.epochs=3", "model.hidden=[32,16]", "model.activation=tanh", "fit.shuffle=no"])
    assert recipe.data["fit"]["epochs"] == 3 and type(recipe.data["fit"]["epochs"]) is int
    assert recipe.data["model"]["hidden"] == [32, 16]
    assert recipe.data["model"]["activation"] == "tanh"
    assert recipe.data["fit"]["shuffle"] is False
    run = recipes.build(recipe)
    widths = [layer.out_features for layer in run.model if isinstance(layer, torch.nn.Linear)]
    assert widths == [32, 16, 3]
    assert isinstance(run.model[1], torch.nn.Tanh)
    assert run.fit_kwargs["epochs"] == 3


def test_set_float_is_a_number(tmp_path):
    path = write(tmp_path, CLASSIFICATION)
    recipe = recipes.load(path, ["optimizer.learning_rate=0.25"])
    assert recipe.data["optimizer"]["learning_rate"] == 0.25
    run = recipes.build(recipe)
    assert float(run.trainer.optimizer.learning_rate) == pytest.approx(0.25)


def test_set_creates_nested_keys(tmp_path):
    path = write(tmp_path, CLASSIFICATION)
    recipe = recipes.load(path, ["evaluate.batch_size=8", "model.dropout=0.1"])
    assert recipe.data["evaluate"] == {"batch_size": 8}
    assert recipe.data["model"]["dropout"] == 0.1
    recipes.validate(recipe)


def test_set_turns_a_plain_name_into_a_mapping(tmp_path):
    path = write(
        tmp_path, CLASSIFICATION.replace("optimizer:\n  type: sgd\n  learning_rate: 0.1\n", "optimizer: adam\n")
    )
    assert recipes.load(path).data["optimizer"] == "adam"
    recipe = recipes.load(path, ["optimizer.learning_rate=0.01"])
    assert recipe.data["optimizer"] == {"type": "adam", "learning_rate": 0.01}
    run = recipes.build(recipe)
    assert type(run.trainer.optimizer).__name__ == "Adam"
    assert float(run.trainer.optimizer.learning_rate) == pytest.approx(0.01)


def test_set_list_item(tmp_path):
    path = write(
        tmp_path,
        CLASSIFICATION + "callbacks:\n  - type: early_stopping\n    patience: 5\n",
    )
    recipe = recipes.load(path, ["callbacks.0.patience=2", "model.hidden.0=12"])
    assert recipe.data["callbacks"][0] == {"type": "early_stopping", "patience": 2}
    assert recipe.data["model"]["hidden"] == [12]


def test_set_replaces_a_whole_section(tmp_path):
    path = write(tmp_path, CLASSIFICATION)
    recipe = recipes.load(path, ["strategy={type: mirrored, devices: [cpu:0, cpu:1]}"])
    assert recipe.data["strategy"] == {"type": "mirrored", "devices": ["cpu:0", "cpu:1"]}
    assert recipes.build(recipe).strategy.num_replicas_in_sync == 2


@pytest.mark.parametrize("override", ["fit.epochs", "fitepochs3", ""])
def test_set_without_equals(tmp_path, capsys, override):
    path = write(tmp_path, CLASSIFICATION)
    status, _, err = run_cli(capsys, "validate", path, "--set", override)
    assert status == 2
    assert "Traceback" not in err
    assert "--set" in err and "key.path=value" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("override", ["fit..epochs=3", ".epochs=3", "=3"])
def test_set_bad_key_path(tmp_path, capsys, override):
    path = write(tmp_path, CLASSIFICATION)
    status, _, err = run_cli(capsys, "validate", path, "--set", override)
    assert status == 2
    assert "Traceback" not in err and "--set" in err


def test_set_value_that_is_not_yaml(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION)
    status, _, err = run_cli(capsys, "validate", path, "--set", "model.hidden=[8, 16")
    assert status == 2
    assert "Traceback" not in err and "cannot parse" in err


def test_set_quoted_number_stays_a_string_and_is_an_error(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION.replace("learning_rate: 0.1", "learning_rate: 0.1   #<"))
    assert recipes.load(path, ['optimizer.learning_rate="0.1"']).data["optimizer"]["learning_rate"] == "0.1"
    status, _, err = run_cli(capsys, "validate", path, "--set", 'optimizer.learning_rate="0.1"')
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "optimizer.learning_rate", "expected a number", "'0.1'")


def test_set_error_points_at_the_overridden_key(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION.replace("epochs: 1", "epochs: 1   #<"))
    status, _, err = run_cli(capsys, "validate", path, "--set", "fit.epochs=0")
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "fit.epochs", "positive")


def test_set_missing_list_item(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION)
    status, _, err = run_cli(capsys, "validate", path, "--set", "model.hidden.3=4")
    assert status == 2
    assert "Traceback" not in err and "model.hidden" in err


@pytest.mark.parametrize("override", ["seed.x=1", "fit.epochs.0=1", "fit.epochs.x=1", "model.hidden.0.x=1"])
def test_set_into_a_scalar(tmp_path, capsys, override):
    """Found by benchmarks/fuzz_recipes.py: a TypeError traceback before."""
    path = write(tmp_path, CLASSIFICATION)
    status, _, err = run_cli(capsys, "validate", path, "--set", override)
    assert status == 2
    assert "Traceback" not in err and "is not a mapping" in err and len(err.strip().splitlines()) == 1


def test_set_unknown_key_gets_did_you_mean(tmp_path, capsys):
    path = write(tmp_path, CLASSIFICATION)
    status, _, err = run_cli(capsys, "validate", path, "--set", "fit.epoch=2")
    assert status == 2
    assert "fit.epoch:" in err and "did you mean 'epochs'?" in err and "Traceback" not in err


# --- environment interpolation ----------------------------------------------------------------
def test_env_interpolation(tmp_path, monkeypatch):
    monkeypatch.setenv("RF_TEST_EPOCHS", "4")
    monkeypatch.setenv("RF_TEST_OPT", "adam")
    monkeypatch.delenv("RF_TEST_LR", raising=False)
    monkeypatch.delenv("RF_TEST_HIDDEN", raising=False)
    path = write(
        tmp_path,
        """
        model:
          type: mlp
          hidden: ${RF_TEST_HIDDEN:-[16, 8]}
        data: digits
        optimizer:
          type: ${RF_TEST_OPT}
          learning_rate: ${RF_TEST_LR:-0.05}
        fit:
          epochs: ${RF_TEST_EPOCHS}
        """,
    )
    recipe = recipes.load(path)
    assert recipe.data["fit"]["epochs"] == 4 and type(recipe.data["fit"]["epochs"]) is int
    assert recipe.data["optimizer"] == {"type": "adam", "learning_rate": 0.05}
    assert recipe.data["model"]["hidden"] == [16, 8]
    recipes.validate(recipe)
    monkeypatch.setenv("RF_TEST_LR", "0.2")
    assert recipes.load(path).data["optimizer"]["learning_rate"] == 0.2


def test_env_default_may_be_empty(tmp_path, monkeypatch):
    monkeypatch.delenv("RF_TEST_UNSET_SEED", raising=False)
    path = write(tmp_path, "seed: ${RF_TEST_UNSET_SEED:-}\nmodel: mlp\ndata: digits\n")
    assert recipes.load(path).data["seed"] is None


def test_env_unset_without_default(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RF_TEST_NOT_SET", raising=False)
    path = write(
        tmp_path,
        """
        model: mlp
        data: digits
        fit:
          epochs: ${RF_TEST_NOT_SET}   #<
        """,
    )
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "", "${RF_TEST_NOT_SET}", "not set", ":-default")


def test_env_interpolation_only_in_the_loader(tmp_path, monkeypatch):
    """--set values are not the file: they are taken literally (the shell already expands them)."""
    monkeypatch.setenv("RF_TEST_ACT", "tanh")
    path = write(tmp_path, CLASSIFICATION)
    recipe = recipes.load(path, ["model.activation=${RF_TEST_ACT}"])
    assert recipe.data["model"]["activation"] == "${RF_TEST_ACT}"


# --- registries and the user's own models and datasets ------------------------------------------
USER_MODULE = '''
from torch import nn


def tiny(inputs: int, outputs: int, width: int = 8) -> nn.Module:
    """A two-layer net from the user's own module."""
    model = nn.Sequential(nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, outputs))
    model.made_by_user = True
    return model
'''


def user_module(tmp_path, monkeypatch) -> str:
    name = unique("rf_user_models")
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_user_model_by_module_attr(tmp_path, capsys, monkeypatch):
    module = user_module(tmp_path, monkeypatch)
    path = write(tmp_path, CLASSIFICATION.replace("type: mlp\n  hidden: [8]", f'type: "{module}:tiny"\n  width: 5'))
    run = recipes.build(recipes.load(path))
    assert getattr(run.model, "made_by_user", False)
    assert (run.model[0].in_features, run.model[0].out_features, run.model[2].out_features) == (4, 5, 3)
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert "validation accuracy:" in out


def test_user_model_by_module_attr_checks_its_arguments(tmp_path, capsys, monkeypatch):
    module = user_module(tmp_path, monkeypatch)
    path = write(
        tmp_path,
        CLASSIFICATION.replace("type: mlp\n  hidden: [8]", f'type: "{module}:tiny"\n  widht: 5   #<'),
    )
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "model.widht", "did you mean 'width'?")


def test_user_module_missing_attribute(tmp_path, capsys, monkeypatch):
    module = user_module(tmp_path, monkeypatch)
    path = write(tmp_path, CLASSIFICATION.replace("type: mlp\n  hidden: [8]", f'type: "{module}:huge"   #<'))
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "model.type", "cannot import", "huge")


def test_register_model_decorator(tmp_path, capsys):
    name = unique("tiny_model")

    def factory(inputs: int, outputs: int, width: int = 6):
        return torch.nn.Sequential(torch.nn.Linear(inputs, width), torch.nn.Linear(width, outputs))

    decorated = register_model(name, "a tiny model registered by a test")(factory)
    assert decorated is factory
    path = write(tmp_path, CLASSIFICATION.replace("type: mlp\n  hidden: [8]", f"type: {name}\n  width: 7"))
    run = recipes.build(recipes.load(path))
    assert run.model[0].out_features == 7
    status, out, _ = run_cli(capsys, "list", "model")
    assert status == 0
    assert re.search(rf"^\s+{name}\s+a tiny model registered by a test$", out, re.M), out
    misspelt = write(tmp_path, CLASSIFICATION.replace("type: mlp", f"type: {name[:-1]}   #<"), "misspelt.yaml")
    status, _, err = run_cli(capsys, "validate", misspelt)
    assert status == 2
    assert_recipe_error(err, misspelt, marked_line(misspelt), "model.type", f"did you mean '{name}'?")


def test_sync_batchnorm_converts_the_built_model_and_a_users_model_without_batchnorm_is_refused(tmp_path):
    synchronized = "hidden: [8]\n  batch_norm: true\n  sync_batchnorm: true"
    path = write(tmp_path, CLASSIFICATION.replace("hidden: [8]", synchronized))
    run = recipes.build(recipes.load(path))
    assert [type(m) for m in run.model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)] == [
        torch.nn.SyncBatchNorm
    ]
    name = unique("no_norm_model")
    register_model(name)(lambda inputs, outputs: torch.nn.Linear(inputs, outputs))
    plain = write(tmp_path, CLASSIFICATION.replace("type: mlp\n  hidden: [8]", f"type: {name}\n  sync_batchnorm: true"))
    with pytest.raises(recipes.RecipeError, match="model.sync_batchnorm: the model has no BatchNorm layer") as caught:
        recipes.build(recipes.load(plain))
    assert "batch_norm: true" not in str(caught.value)  # no hint about the built-in models' argument


def test_the_data_sections_auto_shard_policy_goes_to_the_trainers_input_options(tmp_path):
    from replicafit.data import AutoShardPolicy

    path = write(tmp_path, CLASSIFICATION.replace("n_classes: 3", "n_classes: 3\n  auto_shard_policy: off"))
    run = recipes.build(recipes.load(path))
    assert run.trainer.input_options.auto_shard_policy is AutoShardPolicy.OFF
    assert recipes.build(recipes.load(write(tmp_path, CLASSIFICATION, "plain.yaml"))).trainer.input_options is None


def test_the_cnn_takes_batch_norm_before_each_activation():
    model = builtin_models.cnn(outputs=3, channels=[4, 8], batch_norm=True)
    kinds = [type(m).__name__ for m in model.features]
    assert kinds == ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"] * 2
    assert model.features[0].bias is None  # the BatchNorm's shift replaces it
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 3)


def test_register_model_description_from_docstring(capsys):
    name = unique("doc_model")

    @register_model(name)
    def factory(inputs: int, outputs: int):
        """First line of the docstring.

        More text.
        """
        return torch.nn.Linear(inputs, outputs)

    status, out, _ = run_cli(capsys, "list", "model")
    assert status == 0
    assert re.search(rf"^\s+{name}\s+First line of the docstring\.$", out, re.M), out


def test_duplicate_registration_is_refused():
    name = unique("dup_model")
    register_model(name)(lambda inputs, outputs: torch.nn.Linear(inputs, outputs))
    with pytest.raises(ValueError, match="already registered"):
        register_model(name)(lambda inputs, outputs: torch.nn.Linear(inputs, outputs))
    with pytest.raises(ValueError, match="already registered"):
        register_model("mlp")(lambda inputs, outputs: torch.nn.Linear(inputs, outputs))
    with pytest.raises(ValueError, match="already registered"):
        REGISTRIES["optimizer"].register("adam", object)


def test_register_dataset_decorator(tmp_path, capsys):
    name = unique("user_data")
    calls = []

    @register_dataset(name, "seeded blobs from a test")
    def blobs(n: int = 48, seed: int = 0):
        calls.append(n)
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((n, 5)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64)
        return {"train": (x[:36], y[:36]), "validation": (x[36:], y[36:]), "inputs": 5, "classes": 2}

    path = write(
        tmp_path,
        f"""
        seed: 0
        data:
          type: {name}
          n: 48
        model:
          type: mlp
          hidden: [4]
        metrics: [accuracy]
        fit:
          epochs: 1
          batch_size: 12
          verbose: 0
        """,
    )
    run = recipes.build(recipes.load(path))
    assert calls == [48]
    assert run.model[0].in_features == 5 and run.model[-1].out_features == 2
    assert run.fit_kwargs["validation_data"][0].shape == (12, 5)
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert "validation accuracy:" in out
    status, out, _ = run_cli(capsys, "list", "dataset")
    assert re.search(rf"^\s+{name}\s+seeded blobs from a test$", out, re.M)


def test_registry_names_and_resolve():
    from replicafit.recipes.registry import resolve

    assert {"one_device", "mirrored", "central_storage", "default"} <= set(REGISTRIES["strategy"].names())
    assert {"mlp", "cnn", "linear"} <= set(REGISTRIES["model"].names())
    assert {"digits", "classification", "regression", "npz", "csv"} <= set(REGISTRIES["dataset"].names())
    assert resolve("model", "replicafit.recipes.models:mlp") is REGISTRIES["model"].get("mlp")
    with pytest.raises(KeyError, match="did you mean 'mirrored'"):
        resolve("strategy", "mirored")


@pytest.mark.parametrize(
    "entry",
    [
        "{type: model_checkpoint, filepath: ckpt.pt, save_freq: 5}",
        "{type: backup_and_restore, backup_dir: backup, save_freq: 5}",
        "{type: tensorboard, update_freq: 5}",
        "{type: tensorboard, update_freq: batch}",
    ],
)
def test_callback_frequencies_take_a_number_or_a_word(tmp_path, entry):
    path = tmp_path / "freq.yaml"
    path.write_text(f"model: mlp\ndata: digits\ncallbacks:\n  - {entry}\n")
    recipes.validate(recipes.load(path))


def test_resolve_names_the_new_home_of_a_module_that_moved_out_of_the_trainer():
    """The recipe system, the command and TensorBoard moved out of replicafit.trainer: a recipe that names
    one of their modules by its old path is told the new one (and a top-level old spelling gets the new one)."""
    from replicafit.recipes.registry import resolve

    message = "replicafit.trainer.models is now replicafit.recipes.models: write 'replicafit.recipes.models:mlp'"
    with pytest.raises(ImportError, match=re.escape(message)):
        resolve("model", "replicafit.trainer.models:mlp")
    with pytest.raises(ImportError, match=re.escape("write 'replicafit.recipes.builtins:mirrored'")):
        resolve("strategy", "replicafit.trainer.builtins:mirrored")
    with pytest.raises(ImportError, match=re.escape("write 'replicafit.trainer.callbacks.tensorboard:TensorBoard'")):
        resolve("callback", "trainer.tensorboard:TensorBoard")
    assert resolve("model", "replicafit.recipes.models:mlp") is REGISTRIES["model"].get("mlp")


def test_resolve_old_spelling_and_a_users_own_module_of_that_name(tmp_path, monkeypatch):
    from replicafit.recipes.registry import resolve

    with pytest.raises(ImportError, match="write 'replicafit.optimizers:SGD' instead of 'optimizers:SGD'"):
        resolve("optimizer", "optimizers:SGD")
    with pytest.raises(ImportError, match="write 'replicafit.data.datasets:load_digits'"):
        resolve("dataset", "data.datasets:load_digits")
    # A project's own `trainer` module is the user's to name: it resolves, with no hint.
    (tmp_path / "trainer.py").write_text("def my_model(inputs, outputs):\n    return ('mine', inputs, outputs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "trainer", raising=False)
    try:
        assert resolve("model", "trainer:my_model")(3, 4) == ("mine", 3, 4)
        with pytest.raises(AttributeError):  # their module, their attributes: no old-spelling hint
            resolve("model", "trainer:Trainer")
    finally:
        sys.modules.pop("trainer", None)


def test_a_folder_of_ones_own_named_data_does_not_hide_the_old_spelling_hint(tmp_path, monkeypatch):
    """Regression: with the working directory on sys.path (the replicafit command puts it there), a
    project's data/ folder of files (no __init__.py: a namespace package) took the name, and the old
    spelling failed with a bare ModuleNotFoundError or AttributeError, without the hint."""
    from replicafit.recipes.registry import resolve

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.csv").write_text("x,y\n")
    checkouts = {"", str(pathlib.Path.cwd()), str(pathlib.Path(__file__).resolve().parents[2])}
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in checkouts])  # no data/ of ours
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "data", raising=False)
    try:
        with pytest.raises(ImportError, match="did you mean 'replicafit.data.datasets:load_digits'"):
            resolve("dataset", "data.datasets:load_digits")
        with pytest.raises(ImportError, match="did you mean 'replicafit.data:as_global_batches'"):
            resolve("dataset", "data:as_global_batches")
        with pytest.raises(AttributeError):  # ours has no such name either: no hint
            resolve("dataset", "data:no_such_name")
    finally:
        sys.modules.pop("data", None)


# --- built-in npz and csv datasets ------------------------------------------------------------
def small_table(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    return x, y


def test_npz_dataset_with_named_arrays(tmp_path, capsys):
    x, y = small_table()
    np.savez(tmp_path / "table.npz", pixels=x, target=y, other=np.zeros(3))
    path = write(
        tmp_path,
        f"""
        seed: 0
        data:
          type: npz
          path: {tmp_path / "table.npz"}
          features: pixels
          labels: target
          validation_split: 0.25
        model:
          type: mlp
          hidden: [4]
        metrics: [accuracy]
        fit:
          epochs: 1
          batch_size: 10
          verbose: 0
        """,
    )
    run = recipes.build(recipes.load(path))
    train_x, train_y = run.train
    assert train_x.shape == (30, 3) and train_y.dtype == np.int64
    np.testing.assert_array_equal(train_x, x[:30])
    assert run.model[-1].out_features == 2
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert "validation accuracy:" in out


def test_npz_dataset_errors(tmp_path, capsys):
    x, y = small_table()
    np.savez(tmp_path / "table.npz", x=x, y=y)
    recipe = """
        data:   #<
          type: npz
          path: {path}
          labels: {labels}
        model: mlp
        fit:
          verbose: 0
        """
    path = write(tmp_path, recipe.format(path=tmp_path / "table.npz", labels="target"))
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2
    # the message points at the argument it is about
    message = assert_recipe_error(err, path, line_of(path, "labels:"), "data.labels", "target")
    assert "'x'" in message and "'y'" in message  # names what the file holds
    path = write(tmp_path, recipe.format(path=tmp_path / "missing.npz", labels="y"))
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2
    assert_recipe_error(err, path, line_of(path, "path:"), "data.path", "no such file", "missing.npz")


def write_csv(path, x, y, header=("a", "b", "c", "target")):
    rows = [",".join(header)] + [",".join(f"{v:.5f}" for v in row) + f",{label}" for row, label in zip(x, y)]
    path.write_text("\n".join(rows) + "\n")


def test_csv_dataset_with_named_columns(tmp_path, capsys):
    x, y = small_table()
    write_csv(tmp_path / "table.csv", x, y)
    path = write(
        tmp_path,
        f"""
        seed: 0
        data:
          type: csv
          path: {tmp_path / "table.csv"}
          label: target
          features: [a, c]
          validation_split: 0.25
        model:
          type: mlp
          hidden: [4]
        metrics: [accuracy]
        fit:
          epochs: 1
          batch_size: 10
          verbose: 0
        """,
    )
    run = recipes.build(recipes.load(path))
    train_x, train_y = run.train
    assert train_x.shape == (30, 2)
    np.testing.assert_allclose(train_x, x[:30][:, [0, 2]], atol=1e-4)
    np.testing.assert_array_equal(train_y, y[:30])
    assert run.model[0].in_features == 2 and run.model[-1].out_features == 2
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert "validation accuracy:" in out


def test_csv_dataset_regression(tmp_path):
    x, _ = small_table()
    write_csv(tmp_path / "table.csv", x, x[:, 0] * 2.5)
    path = write(
        tmp_path,
        f"""
        data:
          type: csv
          path: {tmp_path / "table.csv"}
          label: target
          task: regression
        model: linear
        loss: mse
        metrics: [mae]
        """,
    )
    run = recipes.build(recipes.load(path))
    assert run.train[0].shape == (40, 3) and run.train[1].shape == (40, 1)
    assert run.model.out_features == 1


def test_csv_dataset_regression_rejects_accuracy(tmp_path, capsys):
    x, _ = small_table()
    write_csv(tmp_path / "table.csv", x, x[:, 0])
    path = write(
        tmp_path,
        f"""
        data:
          type: csv
          path: {tmp_path / "table.csv"}
          label: target
          task: regression
        model: linear
        loss: mse
        metrics: [accuracy]   #<
        """,
    )
    status, _, err = run_cli(capsys, "validate", path)
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "metrics[0]", "regression")


def test_csv_dataset_errors(tmp_path, capsys):
    x, y = small_table()
    write_csv(tmp_path / "table.csv", x, y)
    recipe = """
        data:   #<
          type: csv
          path: {path}
          label: target
          features: {features}
        model: mlp
        fit:
          verbose: 0
        """
    path = write(tmp_path, recipe.format(path=tmp_path / "table.csv", features="[a, zz]"))
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2
    assert_recipe_error(err, path, line_of(path, "features:"), "data.features", "zz")
    path = write(tmp_path, recipe.format(path=tmp_path / "absent.csv", features="[a]"))
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2
    assert_recipe_error(err, path, line_of(path, "path:"), "data.path", "no such file", "absent.csv")
    (tmp_path / "words.csv").write_text("a,target\nhello,1\n")
    path = write(tmp_path, recipe.format(path=tmp_path / "words.csv", features="[a]"))
    status, _, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 2
    assert_recipe_error(err, path, marked_line(path), "data", "number")


def test_a_worker_failing_while_the_cluster_is_joined_is_not_a_recipe_error(tmp_path, capsys):
    """Regression: it was reported at the recipe's strategy key (exit 2), as if the recipe were wrong."""
    from replicafit.strategies import WorkerFailedError

    def joining(**kwargs):
        raise WorkerFailedError("Worker 1 of 2: another worker died or stopped arriving while joining the cluster")

    registry = REGISTRIES["strategy"]
    name = unique("failing_cluster")
    registry.register(name, joining, description="a strategy whose cluster cannot be joined")
    path = write(tmp_path, CLASSIFICATION.replace("strategy: one_device", f"strategy: {name}"))
    status, out, err = run_cli(capsys, "fit", path, "--run-dir", tmp_path / "run")
    assert status == 69, err  # PEER_FAILED_EXIT_STATUS: the launcher looks for the worker that caused it
    assert err == "error: Worker 1 of 2: another worker died or stopped arriving while joining the cluster\n"
