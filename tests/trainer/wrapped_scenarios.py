"""Wrapped models (PEFT's LoRA, ``torch.compile``) trained by ``fit``: the models and data of
test_wrapped_models.py, and the scenarios its multi-worker tests run in worker processes (``worker_fit``), which
run in one process too as the oracle (``num_workers=None``: Mirrored(2), whose global batches are the workers').
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

import replicafit.strategies as ds
from replicafit import optimizers
from replicafit.trainer import Trainer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path in the worker processes

VOCAB, LENGTH, ROWS, BATCH = 64, 8, 20, 8  # 20 rows in batches of 8: a partial last batch of 4
#: aot_eager runs what inductor compiles (dynamo's graphs, AOTAutograd's forward and backward) without generating
#: C++: inductor works here (gcc) but takes about a minute to compile the tiny GPT-2 on a shared CPU.
BACKEND = "aot_eager"


class TinyLM(torch.nn.Module):
    """A language model of one's own, Hugging Face's way: ``forward(input_ids, labels=None)`` returns its mean
    loss over the tokens and its logits. Cheap to compile (one graph), for the strategies of several workers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def transformers_quietly():
    import transformers

    transformers.logging.set_verbosity_error()  # the tiny config's token ids and loss type are warned about
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    return transformers


def tiny_gpt2():
    """The tiny randomly initialised GPT-2, seeded; no dropout, so that a compiled run (whose dropout draws its
    own random numbers) can equal an eager one."""
    transformers = transformers_quietly()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_head=2,
        n_embd=16,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    # Named, GPT-2's loss is not looked up with a warning, a logging call that breaks torch.compile's graphs there.
    config.loss_type = "ForCausalLM"
    return transformers.GPT2LMHeadModel(config)


def lora_gpt2(task_type=None):
    """``peft.get_peft_model`` of the tiny GPT-2, LoRA on ``c_attn``; without ``task_type`` a ``PeftModel`` whose
    ``forward(*args, **kwargs)`` passes everything to its ``LoraModel``, which passes it to GPT-2."""
    import peft

    transformers_quietly()
    config = peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True, task_type=task_type
    )
    model = peft.get_peft_model(tiny_gpt2(), config)
    torch.manual_seed(1)
    for name, parameter in model.named_parameters():  # lora_B starts at zero: give the first step a gradient to A
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.02)
    return model


def lm_data() -> dict:
    """Token ids with their labels (Hugging Face shifts them itself); padding on the right, labelled -100."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=generator)
    lengths = torch.randint(3, LENGTH + 1, (ROWS,), generator=generator)
    padding = torch.arange(LENGTH) >= lengths[:, None]
    return {"input_ids": ids.masked_fill(padding, 0), "labels": ids.masked_fill(padding, -100)}


def plain_state(state: dict) -> dict:
    """A state dict with torch.compile's ``_orig_mod.`` prefix taken off its keys (to compare with the eager one)."""
    return {key.removeprefix("_orig_mod."): value.detach().clone() for key, value in state.items()}


def make_model(kind: str):
    """``"tiny"``, ``"gpt2"`` or ``"lora"``, each with ``"compiled_"`` in front for its ``torch.compile``."""
    compiled = kind.startswith("compiled_")
    base = kind.removeprefix("compiled_")
    model = {"tiny": TinyLM, "gpt2": tiny_gpt2, "lora": lora_gpt2}[base]()
    return torch.compile(model, backend=BACKEND) if compiled else model


def worker_fit(rank, num_workers, port, *, model: str, strategy: str = "multi_worker", shard_states: bool = False):
    """Two epochs of ``fit`` with the model's own loss (SGD with momentum) as worker ``rank`` of ``num_workers``
    (``strategy``: ``"multi_worker"`` or ``"fully_sharded"``, one replica each); ``num_workers=None``: in this
    process under Mirrored(["cpu:0", "cpu:1"]), the oracle. Returns the trained weights (without the compile
    prefix), what changed, the history and the optimizer's variable names (its slots name their variables)."""
    torch.set_num_threads(1)
    if num_workers is None:
        distribution = ds.MirroredStrategy(["cpu:0", "cpu:1"])
    else:
        resolver = ds.SimpleClusterResolver(num_workers, rank, "127.0.0.1", port, devices=["cpu:0"])
        options = ds.CommunicationOptions(timeout_seconds=60.0)
        if strategy == "fully_sharded":
            distribution = ds.FullyShardedStrategy(options, resolver)
        else:
            distribution = ds.MultiWorkerMirroredStrategy(options, resolver, shard_optimizer_states=shard_states)
    net = make_model(model)
    before = plain_state(net.state_dict())
    trainer = Trainer(distribution, optimizers.SGD(0.2, momentum=0.5), loss=None, metrics=[], seed=0)
    history = trainer.fit(net, lm_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    after = plain_state(trainer.model_state_dict())  # (gathered under FullyShardedStrategy)
    return {
        "weights": after,
        "changed": sorted(key for key in before if not torch.equal(before[key], after[key])),
        "loss": history.history["loss"],
        "trainable": [variable.name for variable in trainer.model.trainable_variables],
        "optimizer_variables": [variable.name for variable in trainer.optimizer.variables],
    }
