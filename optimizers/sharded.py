"""Sharded optimizer states: the pipeline's update on this worker's part of the variables only.

Under ``MultiWorkerMirroredStrategy(shard_optimizer_states=True)`` the strategy cuts the variables into
pieces (``strategies.state_sharding.StateShards``: every gradient bucket cut into one equal chunk per
worker) and each worker keeps the optimizer state of its own pieces only. The optimizer then:

1. builds for **piece variables** instead of the variables: ``build`` (a subclass's own included) is
   called with the 1-D piece variables of this worker (views of the owned elements of each variable), so
   ``add_variable_from_reference`` makes slots shaped like pieces, local to this worker (no collective:
   the pieces differ between workers);
2. receives the gradients as this worker's chunks (reduced during backward in a training step) and runs
   the gradient stages and transforms on them: ``clipnorm`` and ``global_clipnorm`` sum the squares of
   the parts over the workers (one small all-reduce), a loss scaler's finite check is agreed by every
   worker;
3. runs the update rule (``update_step``, or the built-ins' multi-tensor ``_update_many``) on the
   pieces, with their decay and moving averages: every element is updated once, by its owner, in place;
4. gathers the updated pieces into every worker's variables (``StateShards.publish``).

So an element-wise rule gives the unsharded result. A rule that needs a whole tensor (a per-variable
norm as LAMB and LARS use, a factorisation by shape as Adafactor's) declares
``elementwise_update = False`` and is refused under sharding, with a message saying why.

``state_dict()`` gathers every slot into the unsharded layout (one segment at a time; a collective:
every worker calls it, as ``Trainer`` checkpoints do), and ``load_state_dict`` keeps each worker's
pieces of a whole state, so a state moves between sharded and unsharded runs and worker counts.

Example::

    strategy = ds.MultiWorkerMirroredStrategy(shard_optimizer_states=True)
    trainer = Trainer(strategy=strategy, optimizer=optimizers.Adam(1e-3), loss="cross_entropy")
    trainer.fit(model, data, epochs=2)   # each worker keeps Adam's slots of 1/num_workers of the model
"""

from __future__ import annotations

import torch

from replicafit.strategies import context, foreach
from replicafit.strategies.values import local_results

from .tensors import _no_grad

__all__ = ["ShardedStates"]


class ShardedStates:
    """The sharded part of ``Optimizer`` (a mixin): the pieces, their update, and the whole state from them."""

    #: Whether the update rule treats every element on its own (the gradient and slots of an element decide its
    #: update): then the rule is right on slices of variables, which is what sharded optimizer states give it.
    #: A rule that reads a whole tensor (a norm per variable as LAMB or LARS, a factorisation by shape as
    #: Adafactor) sets ``False``: such an optimizer refuses ``shard_optimizer_states`` with a clear error.
    elementwise_update = True

    def _init_sharding(self) -> None:
        self._shards = None  # StateShards of the variables when the strategy shards, else None
        self._piece_source: dict = {}  # id(piece variable) -> position of its variable
        self._sharding_now = None  # the shards during a sharded apply (the loss scaler agrees through them)

    # --- building ----------------------------------------------------------------------------
    def _shards_for(self, strategy, variables):
        """The ``StateShards`` the strategy cuts for ``variables`` (None when it does not shard)."""
        if self._shards is not None:
            if self._shards.matches(variables):
                return self._shards
            raise ValueError(
                f"{type(self).__name__} {self.name!r} keeps sharded optimizer states for its {len(self._variables)} "
                f"variables, and this update gave {len(variables)} other ones: with shard_optimizer_states an "
                "optimizer updates one list of variables (use one optimizer per list)."
            )
        maker = getattr(strategy.extended, "state_shards", None)
        shards = maker(variables) if maker is not None else None
        if shards is None:
            return None
        if not self.elementwise_update:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} declares elementwise_update = False (its update reads whole "
                "variables: a norm per variable, a factorisation by shape), so its state cannot be sharded into "
                "slices of variables. Use MultiWorkerMirroredStrategy(shard_optimizer_states=False) with it."
            )
        if self._variables:
            raise ValueError(
                f"{type(self).__name__} {self.name!r} was built with whole slots (a direct build() call before the "
                "strategy sharded them); with shard_optimizer_states, let the first update (or Trainer's restore) "
                "build it."
            )
        return shards

    def _build_sharded(self, strategy, shards) -> None:
        """Registers the variables and builds for this worker's pieces (``build`` sees piece variables)."""
        self._shards = shards
        for position, variable in enumerate(shards.variables):
            self._built_ids.add(id(variable))
            self._variables.append(variable)
            excluded = self._excluded_from_decay(variable)
            if excluded:
                self._no_decay.add(id(variable))
            for _, piece in shards.pieces_of(position):
                self._piece_source[id(piece)] = position
                if excluded:
                    self._no_decay.add(id(piece))
        with context.enter_or_assert_strategy(strategy):
            self.build(list(shards.piece_variables))

    def _piece_slot(self, container, name: str, value: torch.Tensor):
        """A slot of a piece variable: on this worker only (no collective, unlike a variable's slot)."""
        from replicafit.strategies.variables import LocalVariable

        device = container._device_name()
        tensor = value.to(container._read().device)
        return LocalVariable(tensor, name=f"{container.name}/{name}", device=device, trainable=False)

    # --- the update ------------------------------------------------------------------------------
    def _apply_sharded(self, strategy, shards, grads: list, divisor=None, buffers=None):
        """Steps 3-5 of the pipeline on this worker's pieces, ``grads`` the pieces' reduced gradients (views of
        ``buffers``, the reduction's, which then receive the all-gather)."""
        prepared = None
        self._sharding_now = shards
        try:
            prepared = self._prepared(grads, self._divisor(strategy, divisor))
        finally:
            self._sharding_now = None
        if prepared is None:  # a gradient stage skipped it (agreed by every worker): counted
            self._count()
            return self.iterations
        grads = self._transform_pieces(prepared, shards)
        learning_rate = self._current_learning_rate()
        self._prepare_step(learning_rate)
        ema = self._ema_step()
        if shards.refresh():  # a variable's memory moved (``param.data = ...``): the pieces view it again
            self._plans.clear()
            self._pieces_moved()
        self._update_pieces(shards, grads, learning_rate, ema)
        shards.publish(buffers)
        strategy.extended.after_direct_update(shards.variables)
        self._count()
        return self.iterations

    def _pieces_moved(self) -> None:
        """The piece variables view other memory now (``StateShards.refresh``): what holds their tensors follows."""

    def _update_pieces(self, shards, grads: list, learning_rate: float, ema) -> None:
        pieces = shards.piece_variables
        if not pieces:
            return
        if self._takes_multi_tensor_path():
            self._apply_multi_tensor(grads, pieces, learning_rate, ema)
            return
        decay, no_decay = self.weight_decay, self._no_decay
        for grad, piece in zip(grads, pieces):
            self._update_component(piece, grad, learning_rate, None if id(piece) in no_decay else decay, ema)

    def _transform_pieces(self, grads: list, shards) -> list:
        """Step 3 on pieces: clipping by value as is; norms from the squares of every worker's parts."""
        if self.clipvalue is not None or (self.clipnorm is None and self.global_clipnorm is None):
            return self._transform(grads, shards.piece_variables)
        with _no_grad():
            device = shards.devices[0] if shards.devices else torch.device("cpu")
            squares = torch.zeros(len(shards.variables), dtype=torch.float64, device=device)
            whole = shards.plan.whole  # every worker holds these: worker 0 counts them, once
            counted = [i for i, p in enumerate(shards.pieces) if p.segment not in whole or shards.worker == 0]
            if counted:  # one multi-tensor norm (float32 at least, as the unsharded norms), summed per variable
                wide = [
                    grads[i] if grads[i].dtype in (torch.float32, torch.float64) else grads[i].float() for i in counted
                ]
                parts = torch.stack([n.to(device, torch.float64) for n in foreach.norm(wide)]).square()
                where = torch.tensor([shards.pieces[i].variable for i in counted], device=device)
                squares.index_add_(0, where, parts)
            if self.clipnorm is not None:
                norms = shards.sum(squares, "clipnorm (the norms' parts)").sqrt()
                factors = self.clipnorm / torch.clamp(norms, min=self.clipnorm)
                per_piece = factors[torch.tensor([p.variable for p in shards.pieces], device=device)]
                return list(foreach.mul(grads, list(per_piece.unbind()))) if grads else []
            norm = shards.sum(squares.sum().reshape(1), "global_clipnorm (the norm's parts)").sqrt()[0]
            scale = (self.global_clipnorm / torch.clamp(norm, min=self.global_clipnorm)).to(torch.float32)
            return list(foreach.mul(grads, scale)) if grads else []

    def _agreed(self, flag: bool, what: str) -> bool:
        """``flag`` on every worker during a sharded apply (each saw its own part), else ``flag``."""
        shards = self._sharding_now
        return flag if shards is None else shards.all_workers_agree(flag, what)

    def _piece_names(self, position: int):
        """The slot names of variable ``position``'s pieces here (those of any piece here when this worker owns
        none of that variable: every piece of an element-wise rule has the same), or ``None`` without pieces."""
        pieces = self._shards.pieces_of(position) or list(zip(self._shards.pieces, self._shards.piece_variables))
        if not pieces:
            return None
        return list(self._slot_names.get(id(pieces[0][1]), []))

    # --- whole values from pieces ----------------------------------------------------------------------
    def _slot_names_sharded(self) -> dict:
        """``{position: [slot names]}`` of every variable, agreed across workers (a variable's pieces may all be
        on other workers)."""
        mine: dict = {}
        for piece, variable in zip(self._shards.pieces, self._shards.piece_variables):
            mine.setdefault(piece.variable, list(self._slot_names.get(id(variable), [])))
        names: dict = {}
        for part in self._shards.gather_objects(mine, "the optimizer's slot names"):
            for position, found in part.items():
                names.setdefault(position, found)
        return names

    def _whole_slots(self) -> dict:
        """``{position: {slot name: whole tensor}}``: every slot gathered into the unsharded layout."""
        shards = self._shards
        names = self._slot_names_sharded()
        every = []
        for position in sorted(names):
            for name in names[position]:
                if name not in every:
                    every.append(name)
        for position, variable in enumerate(shards.variables):  # an empty variable has no piece anywhere
            if position not in names and not local_results(variable)[0]._read().numel():
                names[position] = list(every)
        slots: dict = {position: {} for position in range(len(shards.variables))}
        for name in every:
            per_piece = []
            for piece_variable in shards.piece_variables:
                slot = self._slots.get((id(piece_variable), name))
                per_piece.append(None if slot is None else slot._read().detach())
            whole = shards.gather(per_piece, f"the optimizer's {name!r} slots")
            for position, variable in enumerate(shards.variables):
                if name in names.get(position, ()):
                    shape = local_results(variable)[0]._read().shape
                    slots[position][name] = whole[position].view(shape).clone()
        return slots

    def _whole_averages(self, variables) -> list:
        """The whole moving average of each of ``variables`` (a collective on every worker)."""
        shards = self._shards
        per_piece = [self._slots[(id(v), "average")]._read().detach() for v in shards.piece_variables]
        whole = shards.gather(per_piece, "the moving averages")
        positions = {id(v): i for i, v in enumerate(shards.variables)}
        return [whole[positions[id(v)]] for v in variables]

    def _write_averages(self, variables) -> None:
        """Every copy of each of ``variables`` takes its whole moving average (gathered from the pieces)."""
        with _no_grad():
            for variable, average in zip(variables, self._whole_averages(variables)):
                for component in local_results(variable):
                    tensor = component._read()
                    tensor.detach().view(-1).copy_(average.to(tensor.device))


class ShardedSlot:
    """A whole slot of a sharded variable as ``load_state_dict`` writes it: ``assign`` keeps this worker's
    pieces of the value (making the slot for each piece if it has none yet: an optional slot a state brings)."""

    _distribute_strategy = None

    def __init__(self, optimizer, position: int, name: str):
        self.optimizer, self.position, self.name = optimizer, position, name

    def assign(self, value: torch.Tensor) -> None:
        optimizer = self.optimizer
        flat = value.detach().reshape(-1)
        with _no_grad():
            for piece, variable in optimizer._shards.pieces_of(self.position):
                key = (id(variable), self.name)
                if key not in optimizer._slots:
                    optimizer._plans.clear()  # the multi-tensor groups follow each piece's slot names
                    optimizer.add_variable_from_reference(variable, self.name)
                slot = optimizer._slots[key]._read()
                slot.copy_(flat[piece.start : piece.stop].to(slot.device, slot.dtype))
