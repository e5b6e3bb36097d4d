"""Coming from PyTorch: your own module, DataLoader, torch loss, torch optimizer and scheduler.

Everything here is plain torch except three lines: a strategy, ``optimizers.from_torch`` (the torch
optimizer, made distribution-aware) and the ``TorchLRScheduler`` callback (the torch scheduler, stepped
per batch as Lightning's ``interval: "step"``). ``"accuracy"`` is resolved from the shapes of labels
and logits, so it works with ``nn.CrossEntropyLoss``. The module trains on two replicas (logical CPUs
here; GPUs the same way) and ends with the trained weights in your own ``model``.

Run: python examples/from_pytorch.py       (about 97% validation accuracy in a few seconds on 2 cores)
"""

import functools

import numpy as np
import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, TensorDataset

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.data import datasets
from replicafit.trainer import TorchLRScheduler, Trainer


class Net(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Dropout(0.1))
        self.head = nn.Linear(128, classes)

    def forward(self, x):
        return self.head(self.body(x))


def main() -> None:
    x, y = datasets.load_digits(normalize=True)
    order = np.random.default_rng(0).permutation(len(x))  # the file is ordered by writer: shuffle once
    x, y = torch.tensor(x[order]), torch.tensor(y[order])
    train = TensorDataset(x[:1400], y[:1400])
    validation = TensorDataset(x[1400:], y[1400:])
    epochs, batch_size = 10, 64
    loader = DataLoader(train, batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))

    torch.manual_seed(0)
    model = Net()
    trainer = Trainer(
        strategy=ds.MirroredStrategy(["cpu:0", "cpu:1"]),  # each DataLoader batch is split over the replicas
        optimizer=optimizers.from_torch(torch.optim.AdamW, lr=3e-3, weight_decay=0.01),
        loss=nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        seed=0,
    )
    one_cycle = functools.partial(OneCycleLR, max_lr=1e-2, total_steps=epochs * len(loader))
    history = trainer.fit(
        model,
        loader,
        epochs=epochs,
        validation_data=DataLoader(validation, batch_size=256),
        verbose=2,
        callbacks=[TorchLRScheduler(one_cycle, interval="step")],
    )
    print(f"last validation accuracy: {history.history['val_accuracy'][-1]:.4f}")
    model.eval()  # the trained weights are in your own module: plain torch from here on
    with torch.no_grad():
        accuracy = (model(x[1400:]).argmax(dim=1) == y[1400:]).float().mean().item()
    print(f"your module on the validation rows: {accuracy:.4f}")


if __name__ == "__main__":
    main()
