"""``summary(model)``: Keras' ``model.summary()`` for a torch module.

One row per layer (every module that owns parameters or buffers itself, and every leaf
module such as ``ReLU``), with its output shape when an example input is known, and its
parameter count; then the totals, trainable and not, with their size in bytes.

Counting follows Keras: "Param #" and the totals count parameters and floating-point
buffers (batch-norm statistics are Keras' non-trainable weights); integer buffers such as
``num_batches_tracked`` are counters, not weights, and count in the bytes only. A parameter
shared by several modules counts once in the totals. Non-persistent buffers (not in the
``state_dict``) are not counted.

Example::

    >>> from replicafit.trainer import summary
    >>> info = summary(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)),
    ...                input_shape=(64,))
    Model: "Sequential"
    ...
    >>> info.total_params
    9610
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from replicafit.strategies import nest

from .model_io import call_model

__all__ = ["summary", "ModelSummary", "LayerSummary"]

_EXAMPLE_BATCH = 2  # an input_shape becomes a batch of 2 (not 1: a layer may squeeze a batch of one)


@dataclass
class LayerSummary:
    """One row: the module's qualified name, its class, output shape text and own parameter count."""

    name: str
    type_name: str
    output_shape: str
    params: int


@dataclass
class ModelSummary:
    """What ``summary`` found; ``str()`` is the printed table."""

    name: str
    layers: list = field(default_factory=list)
    trainable_params: int = 0
    non_trainable_params: int = 0
    trainable_bytes: int = 0
    non_trainable_bytes: int = 0
    total_bytes: int = 0  # parameters and every persistent buffer, integer ones included
    note: str = ""

    @property
    def total_params(self) -> int:
        """``trainable_params + non_trainable_params`` (``Total params`` in the table; the non-trainable ones
        include frozen parameters and floating buffers such as BatchNorm's statistics)."""
        return self.trainable_params + self.non_trainable_params

    def __repr__(self) -> str:
        return (
            f"ModelSummary(name={self.name!r}, total_params={self.total_params}, "
            f"trainable_params={self.trainable_params}, total_bytes={self.total_bytes})"
        )

    def __str__(self) -> str:
        headers = ("Layer (type)", "Output Shape", "Param #")
        rows = [(f"{r.name} ({r.type_name})", r.output_shape, f"{r.params:,}") for r in self.layers]
        widths = [max([len(headers[i])] + [len(row[i]) for row in rows]) for i in range(3)]
        widths[0], widths[1] = max(widths[0], 28), max(widths[1], 20)
        width = sum(widths) + 6

        def line(cells):
            return f" {cells[0]:<{widths[0]}}   {cells[1]:<{widths[1]}}   {cells[2]:>{widths[2]}}"

        out = [f'Model: "{self.name}"', "_" * width, line(headers), "=" * width]
        out += [line(row) for row in rows] or [" (no layers)"]
        out += [
            "=" * width,
            f"Total params: {self.total_params:,} ({_readable(self.trainable_bytes + self.non_trainable_bytes)})",
            f"Trainable params: {self.trainable_params:,} ({_readable(self.trainable_bytes)})",
            f"Non-trainable params: {self.non_trainable_params:,} ({_readable(self.non_trainable_bytes)})",
        ]
        if self.note:
            out.append(self.note)
        out.append("_" * width)
        return "\n".join(out)


def summary(model: torch.nn.Module, input_shape=None, input_data=None, print_fn=print) -> ModelSummary:
    """Prints a Keras-style summary of ``model`` and returns it as a ``ModelSummary``.

    Args:
      model: a ``torch.nn.Module``.
      input_shape: the shape of one example without the batch dimension (``(64,)``, or
        ``(1, 8, 8)`` for an image), or a list of shapes for a model with several inputs;
        the model then runs once on zeros of the parameters' dtype to find each layer's
        output shape, shown with ``None`` for the batch dimension as Keras does.
      input_data: an example batch (a tensor, array or nest of them) instead of
        ``input_shape``, for inputs that zeros do not fit (token ids, say); floating leaves
        are cast to the parameters' dtype. A dict is passed as the trainer passes it: as
        keyword arguments when ``forward`` names its keys (``{"input_ids": ids,
        "attention_mask": mask}`` for a Hugging Face model), else as one argument.
      print_fn: where the table goes (``None``: not printed).

    The example runs under ``torch.no_grad()`` with the model in eval mode (its mode is
    restored after); a forward that fails leaves the shapes out and says why, it never
    raises. Without an example, the output shape column stays empty (a torch module has
    no static shapes).

    Example::

        info = summary(model, input_shape=(64,))   # prints the table
        info.trainable_params, info.total_bytes
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"summary() needs a torch.nn.Module, got {type(model).__name__}.")
    if input_shape is not None and input_data is not None:
        raise ValueError("Pass input_shape or input_data, not both.")
    rows = _layers(model)
    shapes, note = {}, ""
    if input_shape is not None or input_data is not None:
        shapes, note = _output_shapes(model, rows, input_shape, input_data)
    result = ModelSummary(name=type(model).__name__, note=note)
    for name, module in rows:
        own = sum(_count(t) for t in _weights(module, recurse=False))
        result.layers.append(LayerSummary(name or "(root)", type(module).__name__, shapes.get(name, ""), own))
    for tensor in _weights(model, recurse=True):
        trainable = isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad
        size = tensor.numel() * tensor.element_size()
        if trainable:
            result.trainable_params += tensor.numel()
            result.trainable_bytes += size
        elif _counts_as_weight(tensor):
            result.non_trainable_params += tensor.numel()
            result.non_trainable_bytes += size
        result.total_bytes += size
    if print_fn is not None:
        print_fn(str(result))
    return result


def _layers(model: torch.nn.Module) -> list:
    """``[(qualified name, module)]``: modules that own weights themselves, and leaves."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if next(module.children(), None) is None or next(_weights(module, recurse=False), None) is not None
    ]


def _weights(module: torch.nn.Module, recurse: bool):
    """Parameters and persistent buffers (each tensor once)."""
    seen = set()
    for tensor in module.parameters(recurse=recurse):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor
    persistent = {name for name in module.state_dict(keep_vars=True)}
    for name, tensor in module.named_buffers(recurse=recurse):
        if tensor is None or id(tensor) in seen or name not in persistent:
            continue
        seen.add(id(tensor))
        yield tensor


def _counts_as_weight(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) or tensor.is_floating_point() or tensor.is_complex()


def _count(tensor: torch.Tensor) -> int:
    return tensor.numel() if _counts_as_weight(tensor) else 0


def _output_shapes(model, rows, input_shape, input_data) -> tuple:
    device, dtype = _placement(model)
    batch = None
    if input_data is None:
        shapes = [input_shape] if _is_shape(input_shape) else list(input_shape)
        if not shapes or not all(_is_shape(s) for s in shapes):
            raise ValueError(f"input_shape must be a shape such as (64,) or a list of shapes, got {input_shape!r}.")
        batch = _EXAMPLE_BATCH
        inputs = [torch.zeros((batch, *s), dtype=dtype, device=device) for s in shapes]
    else:
        inputs = nest.map_structure(lambda t: _example_tensor(t, device, dtype), input_data)
        leaves = nest.flatten(inputs)
        batch = leaves[0].shape[0] if leaves and leaves[0].dim() else None
        if isinstance(inputs, Mapping):  # keyword arguments when forward names the keys (model_io's rule)
            return _run_example(model, rows, lambda: call_model(model, inputs), batch)
        inputs = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    return _run_example(model, rows, lambda: model(*inputs), batch)


def _run_example(model, rows, forward, batch) -> tuple:
    """``({layer name: output shape text}, note)`` of one example ``forward()`` (a failure is a note)."""
    found: dict = {}

    def record(name):
        def hook(_module, _inputs, output):  # returns None: the output is left as it is
            found.setdefault(name, _shape_text(output, batch))  # a module called twice shows its first call

        return hook

    hooks = [module.register_forward_hook(record(name)) for name, module in rows]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            forward()
    except Exception as error:  # noqa: BLE001 - a summary never fails on a model's forward
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        return {}, f"(output shapes unavailable: the example forward failed: {type(error).__name__}: {first_line})"
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return found, ""


def _example_tensor(value, device, dtype) -> torch.Tensor:
    """A leaf of ``input_data`` on the model's device; floating leaves in the model's float dtype
    (NumPy's float64 features would not fit a float32 model, as Keras casts them too)."""
    tensor = torch.as_tensor(value).to(device)
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _placement(model) -> tuple:
    for tensor in model.parameters():
        return tensor.device, tensor.dtype if tensor.is_floating_point() else torch.get_default_dtype()
    return torch.device("cpu"), torch.get_default_dtype()


def _is_shape(value) -> bool:
    return isinstance(value, (tuple, list)) and all(isinstance(d, int) and d >= 0 for d in value)


def _shape_text(output, batch) -> str:
    if isinstance(output, torch.Tensor):
        dims = list(output.shape)
        if batch is not None and dims and dims[0] == batch:
            return "(" + ", ".join(["None"] + [str(d) for d in dims[1:]]) + (",)" if len(dims) == 1 else ")")
        return str(tuple(dims))
    if isinstance(output, Mapping):
        return "{" + ", ".join(f"{k}: {_shape_text(v, batch)}" for k, v in output.items()) + "}"
    if isinstance(output, (tuple, list)):
        return "[" + ", ".join(_shape_text(v, batch) for v in output) + "]"
    return type(output).__name__


def _readable(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TB"
