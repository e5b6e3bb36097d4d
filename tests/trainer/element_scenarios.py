"""Element-level losses against a plain torch loop: the models, data and oracle that
``test_element_losses.py`` runs in-process and its worker processes run on 2 workers."""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn as nn

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer, losses

VOCAB, LENGTH, ROWS, CLASSES = 11, 7, 30, 4


class TokenModel(nn.Module):
    """A tiny token tagger: ``(batch, length)`` ids -> scores, classes second (torch) or last (Keras)."""

    def __init__(self, classes_last: bool):
        super().__init__()
        self.classes_last = classes_last
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, VOCAB)

    def forward(self, ids):
        scores = self.out(torch.tanh(self.embed(ids)))
        return scores if self.classes_last else scores.transpose(1, 2)


def token_data():
    """Padded labels (-100 past each row's length); one row with no real token at all."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=generator)
    labels[torch.arange(LENGTH) >= lengths[:, None]] = -100
    labels[3] = -100
    return ids, labels


def classifier_data():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, 6, generator=generator)
    y = torch.randint(0, CLASSES, (ROWS,), generator=generator)
    return x, y


CLASS_WEIGHTS = torch.tensor([0.2, 1.0, 3.0, 0.7])


def case(name: str):
    """``(model, data, our loss, the torch loss of the oracle, scores to the torch loss)`` of a case."""
    torch.manual_seed(0)
    if name == "ignore_index":
        return TokenModel(False), token_data(), nn.CrossEntropyLoss(ignore_index=-100), nn.CrossEntropyLoss(), None
    if name == "ignore_class":
        ours = losses.SparseCategoricalCrossentropy(ignore_class=-100)
        return TokenModel(True), token_data(), ours, nn.CrossEntropyLoss(), lambda p: p.transpose(1, 2)
    if name == "class_weights":
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, CLASSES))
        loss = nn.CrossEntropyLoss(weight=CLASS_WEIGHTS)
        return model, classifier_data(), loss, nn.CrossEntropyLoss(weight=CLASS_WEIGHTS), None
    raise ValueError(name)


CASES = ["ignore_index", "ignore_class", "class_weights"]


def oracle(name: str, batch_size: int, epochs: int = 2, lr: float = 0.5) -> dict:
    """The weights after a plain torch loop on the same global batches (in order, partial last batch)."""
    model, (x, y), _, torch_loss, to_torch = case(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5)
    for _ in range(epochs):
        for start in range(0, len(x), batch_size):
            scores = model(x[start : start + batch_size])
            scores = to_torch(scores) if to_torch else scores
            optimizer.zero_grad()
            torch_loss(scores, y[start : start + batch_size]).backward()
            optimizer.step()
    return model.state_dict()


def ours(name: str, strategy, batch_size: int, epochs: int = 2, lr: float = 0.5, accumulation=None) -> dict:
    """The weights after ``fit`` on the same batches under ``strategy``."""
    model, data, loss, _, _ = case(name)
    optimizer = optimizers.SGD(lr, momentum=0.5, gradient_accumulation_steps=accumulation)
    trainer = Trainer(strategy=strategy, optimizer=optimizer, loss=loss, metrics=["accuracy"], seed=0)
    history = trainer.fit(model, data, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return {"weights": copy.deepcopy(model.state_dict()), "history": history.history}


def largest_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def two_workers(rank, num_workers, port, batch_size=8, accumulation=None):
    """Every case on this worker of a 2-worker MultiWorkerMirroredStrategy."""
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=30), resolver)
    return {name: ours(name, strategy, batch_size=batch_size, accumulation=accumulation) for name in CASES}


def collectives_per_step(rank, num_workers, port):
    """The collectives of each training step of one epoch, for the classifier with a per-example loss and with
    an element-level one (torch's class-weighted cross entropy): ``{"per_example": [...], "element": [...]}``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # workers load this file by its path
    from mw_fit_scenarios import count_collectives_per_run

    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    strategy = ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=30), resolver)
    counts = count_collectives_per_run(strategy)
    out = {}
    for kind, loss in (("per_example", "cross_entropy"), ("element", nn.CrossEntropyLoss(weight=CLASS_WEIGHTS))):
        model, data, _, _, _ = case("class_weights")
        trainer = Trainer(strategy=strategy, optimizer=optimizers.SGD(0.1), loss=loss, metrics=[], seed=0)
        counts.clear()
        trainer.fit(model, data, batch_size=8, shuffle=False, verbose=0)
        out[kind] = list(counts)
    return out
