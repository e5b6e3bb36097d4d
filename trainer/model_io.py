"""How the trainer calls a model and reads what it returns: Keras' and Hugging Face's conventions.

**Inputs.** A dict ``x`` of string keys goes to ``forward`` as keyword arguments, ``model(**x)``
(Hugging Face's convention), when

- ``forward`` names every key as a parameter, or
- ``forward`` takes ``**kwargs`` and names at least one key (the keys it does not name go into
  ``**kwargs``: Hugging Face v5 models take ``**kwargs`` beside ``input_ids``, ``attention_mask``...),
  or takes ``**kwargs`` and no positional argument at all;

it goes as one argument, ``model(x)`` (Keras' convention: the keys are the model's input names),
when ``forward`` names none of its keys. A dict of which ``forward`` names some keys but not the
others, without ``**kwargs``, is an error naming the unknown keys and the parameters ``forward``
has. The decision depends only on ``forward``'s signature and the dict's keys, so it is made once
per model class and key set and cached. Anything that is not such a dict goes as one argument.

**Wrappers.** A module whose ``forward`` takes ``*args, **kwargs`` and nothing else passes its inputs on
to a module it wraps, whose ``forward`` then decides as above (``wrapped_module``): PEFT's ``PeftModel``
(made without ``task_type``) and its ``LoraModel``, torch.compile's ``OptimizedModule``, DDP, a wrapper of
one's own. The wrapped module is what a public ``get_base_model()`` returns (PEFT's accessor; a prompt-tuning
``PeftModel`` has a prompt encoder beside its base model), else the wrapper's only child module. The rule
is followed through several wrappers (``torch.compile`` of a ``PeftModel``); a wrapper with several children
and no ``get_base_model`` is not looked through, and its dict goes as one argument, as to any
``forward(*args, **kwargs)``. The rule reads structure only (no private attribute of torch or PEFT), so a
new wrapper of the same shape needs nothing here; one that keeps a second child module (a loss, a
preprocessing layer) beside what it wraps gives ``forward`` named parameters, or ``get_base_model()``.

**Outputs.** A ``ModelOutput`` is recognised without importing ``transformers``: a ``Mapping`` that
is a dataclass instance with a ``to_tuple`` method (``transformers.utils.ModelOutput`` is an
``OrderedDict`` dataclass with ``to_tuple``; diffusers' ``BaseOutput`` has the same shape). What
losses, metrics and ``predict`` get of a model's output (``select_outputs``, decided once per fit):

1. a tensor, tuple or list: the output as it is (a tuple or list is a Keras multi-output model);
2. a dict or ``ModelOutput`` where the loss is a dict, or the labels are a dict: a multi-output
   model (Keras), its outputs being the entries the loss's (else the labels') keys name; other
   entries (``past_key_values``, hidden states, a ``cache``) are left out; a named entry the output
   lacks is an error;
3. otherwise (one loss for the output, labels that are not a dict, or no labels): its ``logits``;
   without ``logits``, its only tensor (``loss`` aside); entries that are not tensors never count;
4. otherwise a ``ModelOutput`` is an error (which entry is the prediction is unknown), and a plain
   dict of several tensors stays a Keras multi-output model (its labels must then be a dict with
   its keys, as in Keras).

So a Keras multi-output model keeps working as it did (its labels, or its loss, are a dict with
its keys), and a Hugging Face model, or a dict model of one's own returning ``{"logits": ...,
...}``, trains against tensor labels with no wrapper. ``predict`` applies the same rule without
labels: a ``ModelOutput`` gives its logits, a dict of several tensors comes back whole.

**The model's own loss.** ``Trainer(loss=None)`` trains on the loss the model returns:
``model_loss(output)`` reads it (an error when the output has none says to put the labels into the
input dict), and ``inputs_with_labels(model, x, y)`` puts the labels ``y`` under ``"labels"`` for a
model whose ``forward`` names ``labels`` (what Hugging Face's Keras models do when no loss is given).

Example::

    >>> import torch
    >>> class Tagger(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = torch.nn.Embedding(10, 3)
    ...     def forward(self, input_ids, attention_mask=None):
    ...         return {"logits": self.embed(input_ids).sum(1), "cache": None}
    >>> x = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.ones(1, 2)}
    >>> passes_keywords(Tagger(), x)
    True
    >>> output = call_model(Tagger(), x)   # Tagger()(**x)
    >>> prediction_of(output).shape        # its logits
    torch.Size([1, 3])
    >>> passes_keywords(torch.nn.Linear(2, 3), {"features": torch.ones(1, 2)})   # Keras: one argument
    False
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import weakref
from collections.abc import Mapping

import torch

from replicafit.strategies import DistributedModule
from replicafit.strategies.describe import describe_structure

__all__ = [
    "AS_IS",
    "ModelIO",
    "OutputSelection",
    "call_model",
    "counts_items",
    "inputs_with_labels",
    "is_model_output",
    "model_loss",
    "passes_keywords",
    "metric_targets",
    "prediction_of",
    "real_items",
    "select_outputs",
    "wrapped_module",
]


# --- inputs ------------------------------------------------------------------------------------------------------
def call_model(model, x):
    """``model(**x)`` or ``model(x)``, as ``passes_keywords`` decides (once per model class and key set).

    ``model`` is a ``torch.nn.Module`` or a ``DistributedModule`` (inside ``strategy.run`` its
    replica's module is called). A custom ``train_step`` calls the model with it to follow the
    trainer's rule.

    Example::

        output = call_model(self.model, x)   # in a train_step of one's own
    """
    if isinstance(x, Mapping) and x and passes_keywords(model, x):
        return model(**x)
    return model(x)


def passes_keywords(model, x) -> bool:
    """Whether the dict ``x`` goes to ``model``'s ``forward`` as keyword arguments (the module docstring
    has the rule); False for anything but a non-empty dict of string keys.

    Raises ``TypeError`` when ``forward`` names some of ``x``'s keys but not the others and takes no
    ``**kwargs``, naming the unknown keys and the parameters ``forward`` has.

    Example::

        >>> import torch
        >>> passes_keywords(torch.nn.Linear(2, 3), {"input": torch.ones(1, 2)})   # forward(input)
        True
    """
    if not isinstance(x, Mapping) or not x or not all(isinstance(key, str) for key in x):
        return False
    forward = _forward_of(model)
    function = getattr(forward, "__func__", forward)
    keys = tuple(x)
    cached = _CACHE.get(function, keys)
    if cached is not None:
        return cached
    decision = _decide_keywords(forward, keys, model)
    _CACHE.put(function, keys, decision)
    return decision


def _forward_of(model):
    """The ``forward`` whose signature decides: that of the user's module under a ``DistributedModule``, and of
    the module a wrapper passes its inputs to (``wrapped_module``)."""
    module = wrapped_module(model)
    return getattr(module, "forward", module)


def wrapped_module(model) -> torch.nn.Module:
    """The module whose ``forward`` takes ``model``'s inputs in the end: ``model`` itself (the user's module
    under a ``DistributedModule``), or, where its ``forward`` takes only ``*args, **kwargs``, the module it
    wraps, followed through every such wrapper (the module docstring has the rule: a public
    ``get_base_model()``, else the only child module).

    Example::

        >>> import torch
        >>> class Wrapper(torch.nn.Module):
        ...     def __init__(self, inner):
        ...         super().__init__()
        ...         self.inner = inner
        ...     def forward(self, *args, **kwargs):
        ...         return self.inner(*args, **kwargs)
        >>> inner = torch.nn.Linear(2, 3)
        >>> wrapped_module(Wrapper(Wrapper(inner))) is inner
        True
        >>> wrapped_module(inner) is inner
        True
    """
    return _chain(model)[-1]


def _chain(model) -> list:
    """``model`` (the user's module under a ``DistributedModule``) and the modules it passes its inputs on to,
    outermost first; the last one's ``forward`` decides."""
    chain = [model.module if isinstance(model, DistributedModule) else model]
    while True:
        inner = _passed_to(chain[-1])
        if inner is None or any(inner is module for module in chain):  # (a cycle: stop where it closes)
            return chain
        chain.append(inner)


def _passed_to(module):
    """The module that ``module`` passes its inputs to, or None where it is no wrapper (or hides what it wraps)."""
    if not isinstance(module, torch.nn.Module) or not _passes_everything(getattr(module, "forward", None)):
        return None
    base = getattr(module, "get_base_model", None)  # PEFT's public accessor of the model it wraps
    if callable(base):
        try:
            inner = base()
        except Exception:  # noqa: BLE001 - a method of that name with another meaning: the children decide
            inner = None
        if isinstance(inner, torch.nn.Module) and inner is not module:
            return inner
    children = iter(module.children())
    only = next(children, None)
    return only if next(children, None) is None else None


def _passes_everything(forward) -> bool:
    """Whether ``forward``'s parameters are ``*args`` and ``**kwargs`` alone (cached per function)."""
    if forward is None:
        return False
    function = getattr(forward, "__func__", forward)
    cached = _WRAPPERS.get(function, ())
    if cached is not None:
        return cached
    try:
        kinds = [p.kind for p in inspect.signature(forward).parameters.values()]
    except (TypeError, ValueError):
        kinds = []
    decision = sorted(kinds) == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    _WRAPPERS.put(function, (), decision)
    return decision


def _decide_keywords(forward, keys: tuple, model) -> bool:
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): Keras' one argument
        return False
    kinds = inspect.Parameter
    named = [p.name for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in parameters)
    positional = any(
        p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD, kinds.VAR_POSITIONAL) for p in parameters
    )
    known = [key for key in keys if key in named]
    unknown = [key for key in keys if key not in named]
    if not unknown:
        return True
    if var_keyword and (known or not positional):
        return True
    if not known:
        return False
    raise TypeError(
        f"The model's forward({_parameters_text(parameters)}) names the keys {known} of the input dict but not "
        f"{unknown}: a dict of inputs goes to forward as keyword arguments when forward names every key (or takes "
        "**kwargs; Hugging Face's convention), and as one argument when it names none (Keras' convention). Drop or "
        f"rename the keys {unknown} (forward accepts {named}), or give {_forward_name(model)} those parameters or "
        "**kwargs."
    )


def _parameters_text(parameters) -> str:
    kinds = inspect.Parameter
    return ", ".join(
        f"*{p.name}" if p.kind is kinds.VAR_POSITIONAL else f"**{p.name}" if p.kind is kinds.VAR_KEYWORD else p.name
        for p in parameters
    )


def _forward_name(model) -> str:
    """``"GPT2LMHeadModel.forward"``, with the wrappers that pass it their inputs, outermost first:
    ``"GPT2LMHeadModel.forward (wrapped by PeftModel, LoraModel)"``."""
    *wrappers, inner = (type(module).__name__ for module in _chain(model))
    return f"{inner}.forward (wrapped by {', '.join(wrappers)})" if wrappers else f"{inner}.forward"


class _KeywordCache:
    """``(forward function, keys) -> bool``, held no longer than the function (a class defined in a test)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_function: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, function, keys: tuple):
        try:
            return self._by_function.get(function, {}).get(keys)
        except TypeError:  # not weakly referable: decided each time
            return None

    def put(self, function, keys: tuple, decision: bool) -> None:
        with self._lock:
            try:
                self._by_function.setdefault(function, {})[keys] = decision
            except TypeError:
                pass


_CACHE = _KeywordCache()
_WRAPPERS = _KeywordCache()  # (forward function, ()) -> whether it passes everything on


# --- outputs -----------------------------------------------------------------------------------------------------
def is_model_output(value) -> bool:
    """Whether ``value`` is a Hugging Face ``ModelOutput`` (or one of the same shape), without importing
    ``transformers``: a ``Mapping`` that is a dataclass instance with a ``to_tuple`` method.

    Example::

        >>> is_model_output({"logits": 1}), is_model_output((1, 2))
        (False, False)
    """
    return (
        isinstance(value, Mapping)
        and dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and callable(getattr(type(value), "to_tuple", None))
    )


@dataclasses.dataclass(frozen=True)
class OutputSelection:
    """Which part of a model's output the losses, metrics and ``predict`` get (``select_outputs`` decides).

    ``key``: that one entry; ``keys``: a dict of those entries (a multi-output model); neither
    (``AS_IS``): the output as it is. Calling it on an output applies it.

    Example::

        >>> OutputSelection(key="logits")({"logits": 1, "past_key_values": 2})
        1
        >>> OutputSelection(keys=("a",))({"a": 1, "cache": 2})
        {'a': 1}
    """

    key: str | None = None
    keys: tuple | None = None

    def __call__(self, output):
        if self.key is not None:
            return output[self.key]
        if self.keys is not None:
            return {key: output[key] for key in self.keys}
        return output


AS_IS = OutputSelection()


def select_outputs(output, loss=None, labels=None) -> OutputSelection:
    """What losses, metrics and ``predict`` take of ``output``: rules 1-4 of the module docstring.

    ``loss``: the trainer's loss (a dict or list of losses names the outputs); ``labels``: a batch's
    labels (a dict names the outputs; None: unknown, as in ``predict``). Raises ``ValueError`` when
    the named outputs are not in ``output``, or a ``ModelOutput`` has neither ``logits`` nor one tensor.

    Example::

        >>> select_outputs({"a": 1, "b": 2}, loss={"a": "mse", "b": "mae"})   # Keras multi-output
        OutputSelection(key=None, keys=None)
        >>> import torch
        >>> select_outputs({"logits": torch.ones(1), "cache": (torch.ones(1),)}, loss="cross_entropy")
        OutputSelection(key='logits', keys=None)
    """
    if not isinstance(output, Mapping):
        return AS_IS
    names = list(loss) if isinstance(loss, Mapping) else list(labels) if isinstance(labels, Mapping) else None
    if names is not None:
        missing = [name for name in names if name not in output]
        if missing:
            named_by = "loss" if isinstance(loss, Mapping) else "labels"
            raise ValueError(
                f"The {named_by} name the model's outputs {names}, but the model returns {_entries(output)}, without "
                f"{missing}: a dict of {named_by} names the outputs of a multi-output model (Keras' convention). Give "
                f"the {named_by} the model's output names, or return those entries from forward."
            )
        if not is_model_output(output) and list(output) == names:
            return AS_IS
        return OutputSelection(keys=tuple(names))
    if "logits" in output:
        return OutputSelection(key="logits")
    tensors = [key for key, value in output.items() if isinstance(value, torch.Tensor) and key != "loss"]
    if len(tensors) == 1:
        return OutputSelection(key=tensors[0])
    if is_model_output(output):
        raise ValueError(
            f"The model returns a {type(output).__name__} with {_entries(output)}, and no 'logits': which entry the "
            "loss, the metrics and predict take is unknown. Pass a loss per output (loss={name: loss}) with labels "
            "of those names, or a model that returns logits (a model with a task head, e.g. "
            "...ForSequenceClassification)."
        )
    return AS_IS


def prediction_of(output, loss=None, labels=None):
    """What losses, metrics and ``predict`` get of ``output`` (``select_outputs(output, loss, labels)``
    applied): the logits of a ``ModelOutput``, its only tensor, or the output itself.

    Example::

        >>> import torch
        >>> prediction_of({"logits": torch.zeros(2, 3), "hidden_states": (torch.zeros(2, 4),)}).shape
        torch.Size([2, 3])
    """
    return select_outputs(output, loss, labels)(output)


def _entries(output: Mapping) -> str:
    return f"the entries {list(output)}" if output else "no entries"


# --- the model's own loss ----------------------------------------------------------------------------------------
def model_loss(output) -> torch.Tensor:
    """The ``loss`` a model returned with its output (``Trainer(loss=None)`` trains on it).

    A Hugging Face model computes its loss when its inputs include ``labels``; it is then the mean
    over that call's examples (or tokens), not per example. Raises ``ValueError`` when the output
    has no tensor ``loss``, saying how to fix it.

    Example::

        >>> import torch
        >>> model_loss({"loss": torch.tensor(0.5), "logits": torch.zeros(2, 3)})
        tensor(0.5000)
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    found = f"a {type(output).__name__} with {_entries(output)}" if isinstance(output, Mapping) else None
    raise ValueError(
        "Trainer(loss=None) trains on the loss the model returns, but the model returned "
        f"{found or describe_structure(output)}, without a 'loss'. Put the labels into the input dict under "
        "'labels' (a Hugging Face model then returns its loss: {'input_ids': ids, 'attention_mask': mask, "
        "'labels': y}), or pass a loss: Trainer(loss='cross_entropy')."
    )


def inputs_with_labels(model, x, y):
    """``x`` with the labels ``y`` under ``"labels"`` when ``x`` is a dict without ``"labels"`` that goes
    to ``forward`` as keyword arguments and ``forward`` names ``labels`` (a Hugging Face model then
    returns its loss), else ``x`` as it is. ``y=None`` changes nothing.

    Example::

        >>> import torch
        >>> class Classifier(torch.nn.Module):
        ...     def forward(self, input_ids, labels=None):
        ...         return {"logits": input_ids.float()}
        >>> sorted(inputs_with_labels(Classifier(), {"input_ids": torch.ones(2, 3)}, torch.zeros(2)))
        ['input_ids', 'labels']
    """
    if y is None or not isinstance(x, Mapping) or "labels" in x or not passes_keywords(model, x):
        return x
    try:
        parameters = inspect.signature(_forward_of(model)).parameters
    except (TypeError, ValueError):
        return x
    labels = parameters.get("labels")
    if labels is None or labels.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
        return x
    return {**x, "labels": y}


def counts_items(model, inputs) -> bool:
    """Whether the model divides its loss by ``num_items_in_batch`` when given one (Hugging Face's loss
    kwargs), with labels in ``inputs``: then ``Trainer(loss=None)`` passes it and divides by the global
    count of real labels after the gradient reduction (Hugging Face's ``Trainer`` rule: a model's
    ``accepts_loss_kwargs`` attribute if it has one, else whether ``forward`` takes ``**kwargs`` or names
    ``num_items_in_batch``). Set ``accepts_loss_kwargs = False`` on a model whose ``**kwargs`` ignore it.

    Example::

        >>> import torch
        >>> class LM(torch.nn.Module):
        ...     def forward(self, input_ids, labels=None, **kwargs):
        ...         return {"logits": input_ids.float()}
        >>> counts_items(LM(), {"input_ids": torch.ones(1, 2), "labels": torch.ones(1, 2)})
        True
    """
    if not isinstance(inputs, Mapping) or "labels" not in inputs or not passes_keywords(model, inputs):
        return False
    for module in _chain(model):  # the outermost declaration wins: a wrapper may know better than what it wraps
        declared = getattr(module, "accepts_loss_kwargs", None)
        if isinstance(declared, bool):
            return declared
    try:
        parameters = inspect.signature(_forward_of(model)).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "num_items_in_batch" for p in parameters)


def real_items(model, inputs) -> torch.Tensor:
    """The labels of ``inputs`` that a Hugging Face loss counts (not ``-100``): those of ``shift_labels`` when
    given, else of ``labels[..., 1:]`` for a causal language model (its ``loss_function`` is Hugging Face's
    ``ForCausalLMLoss``, which shifts the labels: position 0 is never a target), else of ``labels``
    (Hugging Face's ``Trainer`` counts the same way)."""
    labels = inputs.get("shift_labels")
    if labels is None:
        labels = inputs["labels"]
        labels = labels[..., 1:] if _causal(model) else labels
    return (torch.as_tensor(labels) != -100).sum()


def _causal(model) -> bool:
    """Whether ``model`` is a causal language model whose loss shifts its labels (Hugging Face's
    ``ForCausalLMLoss``, not an encoder-decoder's)."""
    module = wrapped_module(model)  # the model that computes the loss, whatever wraps it
    config = getattr(module, "config", None)
    function = getattr(module, "loss_function", None) if config is not None else None
    return getattr(function, "__name__", "") == "ForCausalLMLoss" and not getattr(config, "is_encoder_decoder", False)


def metric_targets(model, x, y, y_pred) -> tuple:
    """``(labels, predictions)`` that the metrics compare: ``y`` and ``y_pred``; without ``y``, the labels in a dict
    of inputs, where a model that computes its own loss reads them (Hugging Face's convention, ``label_names``):
    ``shift_labels`` as given, else ``labels``, and for a causal language model (its loss shifts them: position
    ``t`` predicts token ``t + 1``) ``labels[..., 1:]`` against ``y_pred[..., :-1, :]``. ``(None, y_pred)`` where
    there are none.

    Example::

        >>> import torch
        >>> labels, logits = metric_targets(torch.nn.Identity(), {"labels": torch.tensor([1, 0])}, None, torch.eye(2))
        >>> labels.tolist()
        [1, 0]
    """
    if y is not None or not isinstance(x, Mapping):
        return y, y_pred
    if "shift_labels" in x:
        return x["shift_labels"], y_pred
    labels = x.get("labels")
    if labels is None or not isinstance(y_pred, torch.Tensor):
        return labels, y_pred
    if _causal(model) and y_pred.dim() >= 3:
        return labels[..., 1:], y_pred[..., :-1, :]
    return labels, y_pred


# --- the decision a trainer keeps ----------------------------------------------------------------------------------
class ModelIO:
    """A trainer's reading of its model's outputs, decided on the first batch of a fit or evaluate.

    ``decide(output, loss, labels)`` stores ``select_outputs``' decision (the first-batch check
    calls it on the probe's output); ``prediction(output, loss, labels)`` applies it to a step's
    output, deciding on that output when no first batch was probed; ``reset()`` forgets it (the next
    fit decides anew). ``call(model, x)`` is ``call_model``.

    Example::

        io = ModelIO()
        io.decide(probe_output, trainer.loss, first_labels)   # once per fit
        y_pred = io.prediction(io.call(model, x))              # per step
    """

    def __init__(self):
        self.selection: OutputSelection | None = None

    def reset(self) -> None:
        self.selection = None

    def decide(self, output, loss=None, labels=None):
        """Stores the decision for ``output`` and returns what it selects of it."""
        self.selection = select_outputs(output, loss, labels)
        return self.selection(output)

    @staticmethod
    def call(model, x):
        return call_model(model, x)

    def prediction(self, output, loss=None, labels=None):
        """What losses and metrics get of a step's ``output`` (decided on it if not decided yet)."""
        selection = self.selection
        if selection is None:  # replicas may race here: each decides the same
            selection = self.selection = select_outputs(output, loss, labels)
        return selection(output)
