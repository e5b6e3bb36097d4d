"""Run on a pseudo-terminal by test_progress_bar.py: a fit with ``verbose="auto"`` (a bar on a terminal)
and many metrics; the history goes to the file named by argv[1]."""

import json
import sys

import torch

import replicafit.strategies as ds
from replicafit.trainer import Trainer

torch.manual_seed(0)
x = torch.randn(400, 6)
y = (x[:, 0] > 0).long()
metrics = ["accuracy", "crossentropy", "sparse_categorical_accuracy"]
trainer = Trainer(strategy=ds.MirroredStrategy(["cpu:0", "cpu:1"]), optimizer="sgd", metrics=metrics, seed=0)
history = trainer.fit(torch.nn.Linear(6, 2), (x, y), batch_size=16, epochs=2, validation_split=0.25, verbose="auto")
with open(sys.argv[1], "w") as file:
    json.dump(history.history, file)
