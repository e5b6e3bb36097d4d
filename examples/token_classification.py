"""Token classification with padding: the exact mean over real tokens, under MirroredStrategy.

A tagger reads sentences of different lengths, padded to one length; the labels of the padding are
``-100``, which ``nn.CrossEntropyLoss`` ignores. torch's ``mean`` divides by the number of real tokens
of the batch, so a batch with long sentences weighs each token as much as a batch with short ones.
``fit`` keeps that exactly under two replicas (logical CPUs here; GPUs or workers the same way): each
replica sums its tokens' losses and counts its real tokens, the counts ride with the gradient
reduction, and the optimizer divides by the global count (``docs/guides/losses.md``). The same model trained
by a plain torch loop on the same batches ends with the same weights.

The data is made here: the tag of a token is a function of the token and the one before it, so the
model has to look back (a 1-d convolution does).

Run: python examples/token_classification.py      (a few seconds on 2 cores)
"""

import copy

import torch
from torch import nn

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer

VOCAB, TAGS, LENGTH, SENTENCES, BATCH = 20, 3, 12, 512, 32


def make_data(seed: int = 0):
    """Sentences of 3..12 tokens (0 is padding), tags (token + previous token) % 3, -100 past the end."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (SENTENCES, LENGTH), generator=generator)
    lengths = torch.randint(3, LENGTH + 1, (SENTENCES,), generator=generator)
    padding = torch.arange(LENGTH) >= lengths[:, None]
    previous = torch.cat([torch.zeros(SENTENCES, 1, dtype=torch.long), tokens[:, :-1]], dim=1)
    tags = (tokens + previous) % TAGS
    return tokens.masked_fill(padding, 0), tags.masked_fill(padding, -100)


class Tagger(nn.Module):
    """Embeddings, a causal 1-d convolution, scores per tag: ``(batch, tags, length)``, torch's layout."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32, padding_idx=0)
        self.conv = nn.Conv1d(32, 64, kernel_size=2, padding=1)
        self.out = nn.Conv1d(64, TAGS, kernel_size=1)

    def forward(self, tokens):
        hidden = self.conv(self.embed(tokens).transpose(1, 2))[..., : tokens.shape[1]]
        return self.out(torch.relu(hidden))


def torch_loop(model, tokens, tags, epochs):
    """The oracle: plain torch on the same batches, in the same order."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    loss = nn.CrossEntropyLoss(ignore_index=-100)
    for _ in range(epochs):
        for start in range(0, len(tokens), BATCH):
            optimizer.zero_grad()
            loss(model(tokens[start : start + BATCH]), tags[start : start + BATCH]).backward()
            optimizer.step()


def main():
    tokens, tags = make_data()
    torch.manual_seed(0)
    model = Tagger()
    reference = copy.deepcopy(model)

    trainer = Trainer(
        strategy=ds.MirroredStrategy(["cpu:0", "cpu:1"]),
        optimizer=optimizers.SGD(0.5, momentum=0.9),
        loss=nn.CrossEntropyLoss(ignore_index=-100),
        metrics=["accuracy"],  # per real token: the classes are dimension 1 of torch's layout
        seed=0,
    )
    history = trainer.fit(model, (tokens, tags), batch_size=BATCH, epochs=6, shuffle=False, verbose=0)
    real = int((tags != -100).sum())
    print(f"{real} real tokens of {tags.numel()} positions")
    print(f"token accuracy after {len(history.history['loss'])} epochs: {history.history['accuracy'][-1]:.3f}")

    torch_loop(reference, tokens, tags, epochs=6)
    with torch.no_grad():
        difference = max(float((a - b).abs().max()) for a, b in zip(model.parameters(), reference.parameters()))
    print(f"largest weight difference from a plain torch loop: {difference:.1e}")


if __name__ == "__main__":
    main()
