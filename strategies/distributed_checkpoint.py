"""Tensors written and read by every worker with torch's distributed checkpoint (``torch.distributed.checkpoint``).

The one place that calls ``torch.distributed.checkpoint``: a sharded checkpoint (``trainer.sharded_checkpoint``)
hands it a flat dict of tensors. A ``DTensor`` is written as its shards, each worker writing its own (no gather
anywhere); a plain tensor, the same on every worker, is written once. Reading fills a dict of targets in place:
a ``DTensor`` target receives its shards as its layout cuts them (resharded: the checkpoint may come from any
number of workers), a plain target the whole tensor. With one worker (or outside a cluster) nothing communicates.
The cluster's process group carries the plan exchange, bounded by the strategy's communication timeout.

Example (every worker of a ``FullyShardedStrategy``)::

    write_shards({"model/w": dm.trainable_variables[0].read_value()}, "ckpt", strategy.cluster)
    targets = {"model/w": torch.empty(whole_shape)}          # in one process: the whole tensor
    read_shards(targets, "ckpt", strategy.cluster)
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

__all__ = ["PiecedValue", "read_shards", "write_shards"]


class PiecedValue:
    """A value of ``shape`` whose flattened elements are parts of other tensors (what a sharded checkpoint writes
    for an optimizer slot whose pieces live in the padded buffers of sharded optimizer states): ``parts`` lists
    ``(tensor, offset, start, stop)`` — elements ``start:stop`` of the value are ``tensor.reshape(-1)[offset:offset +
    stop - start]``. The tensors (``DTensor`` s of every worker's chunks, or plain tensors every worker holds) are
    written once each; reading them back and ``assemble`` gives the whole value.

    Example::

        value = PiecedValue((2, 3), torch.float32, [(segment, 0, 0, 6)])
        value.assemble({id(segment): loaded_segment})      # the whole (2, 3) tensor
    """

    __slots__ = ("shape", "dtype", "parts")

    def __init__(self, shape, dtype, parts: list):
        self.shape, self.dtype, self.parts = tuple(shape), dtype, list(parts)

    def assemble(self, loaded) -> torch.Tensor:
        """The whole value from ``loaded(tensor)``: each part's tensor as read back whole."""
        numel = 1
        for size in self.shape:
            numel *= int(size)
        whole = torch.zeros(numel, dtype=self.dtype)
        for tensor, offset, start, stop in self.parts:
            whole[start:stop] = loaded(tensor).reshape(-1)[offset : offset + stop - start].to(self.dtype)
        return whole.view(self.shape)


def _distributed(cluster) -> bool:
    import torch.distributed as dist

    return cluster.num_workers > 1 and dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet(distributed: bool):
    """Without a process group torch warns that it assumes one process: that is what ``no_dist`` asked for."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to", category=UserWarning)
        yield


def write_shards(tensors: dict, directory, cluster) -> None:
    """*Collective.* Writes ``tensors`` (``{str: tensor}``) into ``directory``: every worker its shards of each
    ``DTensor``, plain tensors once (torch's format: ``.metadata`` and one ``.distcp`` file per worker)."""
    import torch.distributed.checkpoint as dcp

    distributed = _distributed(cluster)
    with _quiet(distributed):
        dcp.save(dict(tensors), checkpoint_id=os.fspath(directory), no_dist=not distributed)


def read_shards(targets: dict, directory, cluster) -> None:
    """*Collective.* Fills ``targets`` (``{str: tensor}``, as ``write_shards`` keyed them) from ``directory``: a
    ``DTensor`` target with its own shards, a plain one whole. Raises ``RuntimeError`` (torch's) where a key is
    missing or a shape differs."""
    import torch.distributed.checkpoint as dcp

    distributed = _distributed(cluster)
    with _quiet(distributed):
        dcp.load(targets, checkpoint_id=os.fspath(directory), no_dist=not distributed)
