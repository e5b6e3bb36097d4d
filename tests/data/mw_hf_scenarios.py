"""Hugging Face ``datasets`` through ``Trainer``: the shared pieces of ``test_hf_datasets.py`` (a tiny GPT-2,
token rows, collators) and the scenario its two worker processes run (``run_workers``)."""

from __future__ import annotations

import collections

import datasets
import tokenizers
import torch
import transformers
from tokenizers.models import WordLevel

import replicafit.strategies as ds
from replicafit import data, optimizers
from replicafit.trainer import LambdaCallback, Trainer

VOCAB, LENGTH, ROWS, BATCH = 64, 10, 20, 8
PAD = 0  # the padding id: real tokens are 1 .. VOCAB - 1


def tiny_gpt2():
    """A randomly initialised GPT-2 of one layer, without dropout (so that only the data tells two runs apart)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        vocab_size=VOCAB,
        n_positions=32,
        bos_token_id=PAD,
        eos_token_id=PAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def token_rows(rows: int = ROWS, ragged: bool = False, row_ids: bool = False) -> datasets.Dataset:
    """``input_ids`` and ``labels`` (the same tokens: GPT-2 shifts them) of ``LENGTH`` tokens each; ``ragged``:
    ``input_ids`` alone, 3 to ``LENGTH`` tokens long (a collator pads them and makes the labels); ``row_ids``: a
    ``row`` column numbering them."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (rows, LENGTH), generator=generator)
    if ragged:
        lengths = torch.randint(3, LENGTH + 1, (rows,), generator=generator).tolist()
        columns = {"input_ids": [ids[i, :n].tolist() for i, n in enumerate(lengths)]}
    else:
        columns = {"input_ids": ids.tolist(), "labels": ids.tolist()}
    if row_ids:
        columns["row"] = list(range(rows))
    return datasets.Dataset.from_dict(columns)


def pad_rows(rows: list) -> dict:
    """A plain-function collator: pads ``input_ids`` on the right, with the ``attention_mask`` and labels
    (``-100`` on the padding), from rows in any format."""
    ids = [torch.as_tensor(row["input_ids"]) for row in rows]
    width = max(len(t) for t in ids)
    input_ids = torch.full((len(ids), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, t in enumerate(ids):
        input_ids[i, : len(t)], mask[i, : len(t)] = t, 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, -100)}


def tiny_tokenizer():
    """A word-level tokenizer built in memory (no download) whose padding id is ``PAD``."""
    vocab = {"[PAD]": PAD, **{f"t{i}": i for i in range(1, VOCAB)}}
    model = tokenizers.Tokenizer(WordLevel(vocab, unk_token="t1"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=model, pad_token="[PAD]")


def language_model_collator():
    """Hugging Face's collator for causal language models: pads, masks and makes ``labels`` (-100 on padding)."""
    return transformers.DataCollatorForLanguageModeling(tiny_tokenizer(), mlm=False)


def make_trainer(strategy=None) -> Trainer:
    return Trainer(strategy, optimizer=optimizers.SGD(0.5, momentum=0.5), loss=None, metrics=(), seed=0)


def weights_of(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Counting(datasets.Dataset):
    """A ``datasets.Dataset`` that records the row indices it is asked for (``reads``): one at a time
    (``dataset[i]``) or a batch of them (``__getitems__``, as a ``DataLoader`` and ``fit`` read)."""

    def __getitem__(self, key):
        if isinstance(key, int):
            self.reads.append(key)
        return super().__getitem__(key)  # (a list of keys comes from __getitems__, which counted them)

    def __getitems__(self, keys):
        self.reads.extend(int(k) for k in keys)
        return super().__getitems__(keys)


def counting(dataset: datasets.Dataset) -> Counting:
    """``dataset`` recording the indices it reads (its class swapped, its table and format kept)."""
    dataset.__class__ = Counting
    dataset.reads = []
    return dataset


def map_style_run(strategy) -> dict:
    """fit (2 epochs, shuffled), evaluate and predict on a counting torch-format ``Dataset``, then fit on ragged
    rows with a padding collator: results, and which rows were read (per epoch for fit)."""
    rows = counting(token_rows().with_format("torch"))
    model = tiny_gpt2()
    trainer = make_trainer(strategy)
    epochs_read = []
    marks = LambdaCallback(on_epoch_end=lambda epoch, logs: epochs_read.append(list(rows.reads)))
    history = trainer.fit(model, rows, batch_size=BATCH, epochs=2, callbacks=[marks], verbose=0)
    fit_reads = [epochs_read[0], epochs_read[1][len(epochs_read[0]) :]]
    rows.reads = []
    evaluation = trainer.evaluate(model, rows, batch_size=BATCH, verbose=0, return_dict=True)
    evaluate_reads, rows.reads = rows.reads, []
    predictions = trainer.predict(model, rows, batch_size=BATCH)
    padded = tiny_gpt2()
    make_trainer(strategy).fit(
        padded, data.CollatedDataset(token_rows(ragged=True), pad_rows), batch_size=BATCH, verbose=0
    )
    return {
        "history": history.history,
        "weights": weights_of(model),
        "evaluate": evaluation,
        "predict": predictions,
        "reads": {"fit": fit_reads, "evaluate": evaluate_reads, "predict": rows.reads},
        "padded": weights_of(padded),
    }


def stream_run(strategy) -> dict:
    """fit (2 epochs) on a 2-shard ``IterableDataset``: the history, and the rows read (in order)."""
    reads = []

    def record(example):
        reads.append(int(example["row"]))
        return {}

    stream = token_rows(row_ids=True).to_iterable_dataset(num_shards=2).map(record, remove_columns=["row"])
    model = tiny_gpt2()
    history = make_trainer(strategy).fit(model, stream, batch_size=BATCH, epochs=2, verbose=0)
    return {"history": history.history, "reads": reads, "weights": weights_of(model)}


def strategy_for(rank, num_workers, port):
    resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port)
    return ds.MultiWorkerMirroredStrategy(ds.CommunicationOptions(timeout_seconds=30.0), resolver)


def two_workers(rank, num_workers, port) -> dict:
    """Both runs on this worker of a MultiWorkerMirroredStrategy cluster (one interpreter start for both)."""
    strategy = strategy_for(rank, num_workers, port)
    return {"map_style": map_style_run(strategy), "stream": stream_run(strategy)}


def each_once(*parts) -> bool:
    """Whether the index lists ``parts`` together hold every row exactly once."""
    return collections.Counter(i for part in parts for i in part) == collections.Counter(range(ROWS))
