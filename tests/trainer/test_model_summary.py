"""``summary(model)``: Keras' model.summary() for torch modules; counts checked against the tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import replicafit as rf
from replicafit.recipes import models
from replicafit.trainer import summary


def quiet(model, **kwargs):
    return summary(model, print_fn=None, **kwargs)


def test_digits_mlp_parameter_count_and_table(capsys):
    model = models.mlp(inputs=64, outputs=10, hidden=[128])
    info = summary(model, input_shape=(64,))
    assert info.total_params == info.trainable_params == 64 * 128 + 128 + 128 * 10 + 10 == 9610
    assert info.total_params == sum(p.numel() for p in model.parameters())
    assert info.non_trainable_params == 0
    assert info.trainable_bytes == info.total_bytes == 9610 * 4
    assert [(r.name, r.type_name, r.output_shape, r.params) for r in info.layers] == [
        ("0", "Linear", "(None, 128)", 8320),
        ("1", "ReLU", "(None, 128)", 0),
        ("2", "Linear", "(None, 10)", 1290),
    ]
    out = capsys.readouterr().out
    assert out == str(info) + "\n"
    lines = out.splitlines()
    assert lines[0] == 'Model: "Sequential"'
    assert lines[2].split() == ["Layer", "(type)", "Output", "Shape", "Param", "#"]
    assert lines[4].split() == ["0", "(Linear)", "(None,", "128)", "8,320"]
    assert "Total params: 9,610 (37.54 KB)" in lines
    assert "Trainable params: 9,610 (37.54 KB)" in lines
    assert "Non-trainable params: 0 (0.00 B)" in lines


def test_batch_norm_statistics_are_non_trainable_and_counters_are_not_weights():
    model = models.mlp(inputs=64, outputs=10, hidden=[32], batch_norm=True)
    info = quiet(model)
    assert info.trainable_params == 64 * 32 + 32 + 2 * 32 + 32 * 10 + 10
    assert info.non_trainable_params == 2 * 32  # running mean and variance; num_batches_tracked is a counter
    assert info.total_bytes == (info.trainable_params + info.non_trainable_params) * 4 + 8  # the int64 counter
    assert next(r for r in info.layers if r.type_name == "BatchNorm1d").params == 4 * 32
    assert all(r.output_shape == "" for r in info.layers)  # no example input: no shapes


def test_frozen_shared_and_non_persistent_tensors():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight  # tied weights count once
            self.frozen = torch.nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.register_buffer("scratch", torch.zeros(100), persistent=False)

        def forward(self, tokens):
            return self.head(self.frozen(self.embed(tokens)))

    info = quiet(Net(), input_data=torch.tensor([[1, 2, 3]]))
    assert info.trainable_params == 40
    assert info.non_trainable_params == 20
    assert [(r.name, r.output_shape) for r in info.layers] == [
        ("embed", "(None, 3, 4)"),
        ("head", "(None, 3, 10)"),
        ("frozen", "(None, 3, 4)"),
    ]


def test_several_inputs_and_outputs_and_weights_owned_by_the_root():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))
            self.a, self.b = torch.nn.Linear(3, 2), torch.nn.Linear(5, 4)

        def forward(self, x, y):
            return {"a": self.a(x * self.scale), "b": (self.b(y), y)}

    info = quiet(TwoHeads(), input_shape=[(3,), (5,)])
    assert info.layers[0].name == "(root)" and info.layers[0].params == 3
    assert info.layers[0].output_shape == "{a: (None, 2), b: [(None, 4), (None, 5)]}"
    assert info.total_params == 3 + 8 + 24


def test_the_example_forward_leaves_the_model_as_it_was():
    model = models.mlp(inputs=8, outputs=2, hidden=[4], batch_norm=True, dropout=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    quiet(model, input_data=np.ones((3, 8)))  # float64 NumPy rows are cast to the model's dtype
    assert model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # eval: statistics untouched
    assert all(p.grad is None for p in model.parameters())
    assert not model._forward_hooks and not any(m._forward_hooks for m in model.modules())


def test_a_failing_forward_is_reported_not_raised():
    info = quiet(models.mlp(inputs=64, outputs=10), input_shape=(63,))
    assert "output shapes unavailable" in info.note and "RuntimeError" in info.note
    assert info.total_params == 64 * 128 + 128 + 1290
    assert info.note in str(info)


def test_float64_model_bytes():
    info = quiet(torch.nn.Linear(3, 2).double(), input_shape=(3,))
    assert info.total_bytes == 8 * 8 and info.layers[0].output_shape == "(None, 2)"


@pytest.mark.parametrize(
    "args,error",
    [
        (("not a module",), TypeError),
        ((torch.nn.Linear(2, 2), "2"), ValueError),
        ((torch.nn.Linear(2, 2), [(2,), "x"]), ValueError),
    ],
)
def test_bad_arguments(args, error):
    with pytest.raises(error):
        summary(*args, print_fn=None)
    with pytest.raises(ValueError, match="not both"):
        quiet(torch.nn.Linear(2, 2), input_shape=(2,), input_data=torch.zeros(1, 2))


def test_exported_at_the_root():
    assert rf.summary is summary
    assert repr(quiet(torch.nn.Linear(2, 2))) == (
        "ModelSummary(name='Linear', total_params=6, trainable_params=6, total_bytes=24)"
    )
