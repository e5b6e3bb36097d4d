"""Per-replica random streams: what torch draws inside a replica comes from that replica's own stream.

Every replica of a strategy (``OneDeviceStrategy``, ``MirroredStrategy``, ``CentralStorageStrategy``,
``MultiWorkerMirroredStrategy``) owns a random stream: a state of torch's CPU generator, and of its
GPU's generator when the replica runs on one. While the replica's code runs (``strategy.run``, the
``merge_call`` functions it calls, its backward pass), its stream is the one in force: dropout,
``torch.rand*``, ``Tensor.uniform_``, random augmentations in the step all draw from it, and it
advances only by what that replica draws. So results do not depend on the order in which replicas
run, and a replica's draws are the same whether the replicas of its worker take turns on one thread
or run on threads of their own, and whether the run was resumed from a backup.

The streams are derived from ``(seed, global replica id)`` (NumPy's ``SeedSequence`` spawn rule):
``seed_replicas(strategy, seed)`` sets them (``Trainer(seed=...)`` does at the start of ``fit``); until
then a strategy seeds them at its first ``run`` from one draw of torch's global generator, so
``torch.manual_seed`` before the run makes it reproducible too. Global ids make the streams of a
multi-worker run those of ``MirroredStrategy`` with as many replicas in one process, and keep the
workers' dropout masks apart (the same seed in every process would correlate them).

``fit`` keys the streams (``ReplicaStreams.key``): before each training step, and before each epoch's
validation, every replica's stream starts over at a state that depends only on ``(seed, global replica id,
epoch, step)``, as JAX training loops fold the step into the key. A fit resumed at any step then draws what
the uninterrupted fit drew there, for every replica, whatever streams its backup holds (a survivor's backup
after a peer's failure holds only its own). ``strategy.run`` in a loop of one's own continues the streams.

Outside replicas (the default strategy, code between ``run`` calls, data loading) torch's global
generator is used as usual. A ``DataLoader``'s worker processes draw their base seed at each epoch
from the loader's ``generator=`` (else from torch's global generator) and seed torch, ``random`` and
NumPy in each worker from it; other libraries need a ``worker_init_fn`` (torch's "Randomness in
multi-process data loading" notes).

Where the replicas of one worker run on threads side by side (replicas on distinct GPUs; or on
the CPU with a ``CommunicationOptions`` timeout, ``set_replica_execution("threads")``, or a
differentiable collective), each GPU's generator is still the replica's own (logical GPUs that share
one GPU, ``set_logical_device_configuration``, have their draws routed as below). Replicas on the CPU
have their CPU draws routed to their stream for torch's random functions (``torch.rand*``,
``bernoulli``, ``multinomial``, ``normal``, ``randperm``, the in-place ``Tensor`` samplers, the
dropout family, ``rrelu``, ``gumbel_softmax``, ``scaled_dot_product_attention``): the same draws as
taking turns, at some cost per torch call. Two gaps remain on threads, both outside the defaults: a
random draw deep inside another torch function (an ``nn.LSTM``'s inter-layer dropout on the CPU),
and CPU draws of replicas that run on GPUs, come from the CPU generator the threads share.

Difference from TensorFlow: TensorFlow's stateful random ops under ``MirroredStrategy`` share one
op-level seed and a ``tf.random.Generator`` created in a strategy's scope splits per replica; here
every replica has its stream without creating anything; and ``fit`` keys the streams per step, where a
Keras ``SeedGenerator`` continues its state across steps.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import torch

__all__ = ["seed_replicas", "replica_seed"]

_MAX_SEED = 2**64 - 1
_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment
_KEYED = 0x5EED  # the last word of a keyed stream's spawn key: a family of its own (see ReplicaStreams.key)
TRAINING, VALIDATION = 0, 1  # the kinds of keyed streams fit uses


def replica_seed(seed: int, global_replica_id: int, *salt: int) -> int:
    """The seed of global replica ``global_replica_id``'s stream when the run's seed is ``seed``
    (``salt``: further non-negative ints that select another family of streams).

    Example::

        >>> replica_seed(0, 0) != replica_seed(0, 1)
        True
    """
    sequence = np.random.SeedSequence(int(seed), spawn_key=(int(global_replica_id), *map(int, salt)))
    return int(sequence.generate_state(1, np.uint64)[0])


def _mix64(value: int) -> int:
    """splitmix64's output function: a bijection of 64-bit integers that spreads every input bit."""
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def seed_replicas(strategy, seed: int) -> None:
    """Seeds every replica's random stream of ``strategy`` from ``(seed, global replica id)``.

    Each process of a multi-worker run calls it with the same ``seed``; the replicas still get
    distinct streams (their global ids differ). ``Trainer(seed=...)`` calls it at the start of ``fit``.

    Example::

        strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"])
        ds.seed_replicas(strategy, 0)
        masks = strategy.run(lambda: torch.rand(3))   # two different draws, the same every run
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) <= _MAX_SEED:
        raise ValueError(f"seed_replicas() takes an integer seed in [0, 2**64 - 1], got {seed!r}.")
    streams = strategy.extended._replica_streams
    if streams is not None:
        streams.seed(int(seed))


def _accelerator_generator(device: torch.device):
    """The default generator of ``device`` when it has its own (a CUDA GPU), else None."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None


def _seeded_state(generator, value: int) -> torch.Tensor:
    """The state ``generator`` (a GPU's default one) would have if seeded with ``value``; it is left as it was."""
    saved = generator.get_state()
    try:
        generator.manual_seed(value)
        return generator.get_state()
    finally:
        generator.set_state(saved)


class ReplicaStreams:
    """The random streams of one worker's replicas (``strategy.extended._replica_streams``).

    Holds per local replica a CPU generator state and, for a replica on a GPU, that GPU's
    generator state. ``put(r)`` makes replica ``r``'s stream the one in force, ``take(r)`` keeps
    what it advanced to; the runner calls them around every stretch of a replica's code.
    """

    def __init__(self, torch_devices: tuple, first_global_id: int):
        self._devices = tuple(torch_devices)
        self._first = first_global_id
        self._accelerators = [_accelerator_generator(d) for d in self._devices]
        self._route_cpu = all(g is None for g in self._accelerators)
        # Logical GPUs on one physical GPU share its generator: on threads their draws are routed too.
        self._shared = [d.type != "cpu" and self._devices.count(d) > 1 for d in self._devices]
        self.base_seed = None
        self._roots = None  # ((base seed, epoch, kind), [root per local replica]) of the last key()
        self._keys: list | None = None  # per local replica: the seed key() gave, until its state is made
        self._cpu: list | None = None  # per local replica: a torch CPU generator state
        self._gpu: list | None = None  # per local replica: its GPU generator's state (or None)
        self._lock = threading.Lock()

    def seed(self, seed: int, salt: tuple = ()) -> None:
        cpu, gpu = [], []
        for r, generator in enumerate(self._accelerators):
            value = replica_seed(seed, self._first + r, *salt)
            cpu.append(torch.Generator().manual_seed(value).get_state())
            gpu.append(None if generator is None else _seeded_state(generator, value))
        self._cpu, self._gpu, self._keys, self.base_seed = cpu, gpu, None, seed

    def ensure_seeded(self) -> None:
        """Seeds the streams from one draw of torch's global generator, the first time only."""
        if self._cpu is None:
            with self._lock:
                if self._cpu is None:
                    generator = torch.default_generator
                    self.seed(int(torch.randint(0, 2**62, (), device="cpu", generator=generator)))

    def key(self, epoch: int, step: int, kind: int = TRAINING) -> None:
        """Starts every replica's stream over at a state that depends only on ``(base seed, global replica id,
        epoch, kind, step)``: ``fit`` keys the streams before each training step (``kind=TRAINING``) and before
        its validation (``kind=VALIDATION``, ``step=0``), as JAX training loops fold the step into the key. So
        a fit resumed at any step draws what the uninterrupted fit drew there, for every replica, whatever the
        backup holds of the streams (a survivor's backup after a peer's failure holds only its own).

        Each replica's seed is ``mix(root + step * 0x9E3779B97F4A7C15)`` (splitmix64), its root drawn once per
        epoch with ``replica_seed(base seed, global id, epoch, kind, 0x5EED)``. torch's CPU generator takes the
        low 32 bits of a seed (mt19937), so two keyed steps' streams coincide with probability 2**-32 a pair.

        Example::

            streams.key(epoch=2, step=7)  # what replica r draws next: the same in every run of this seed
        """
        if self._cpu is None:
            self.ensure_seeded()
        base, roots = self.base_seed, self._roots
        if roots is None or roots[0] != (base, epoch, kind):
            first = self._first
            roots = (
                (base, epoch, kind),
                [replica_seed(base, first + r, epoch, kind, _KEYED) for r in range(len(self._devices))],
            )
            self._roots = roots
        offset = (step * _GOLDEN) & _MASK
        keys = [_mix64((root + offset) & _MASK) for root in roots[1]]
        # The CPU states are made when first needed (put: the generator seeded in place, the cheaper way).
        if not self._route_cpu:  # (some replica on a GPU)
            self._gpu = [None if g is None else _seeded_state(g, v) for g, v in zip(self._accelerators, keys)]
        self._keys = keys

    def _settle(self, r: int) -> None:
        """Makes replica ``r``'s CPU state from the seed ``key`` gave it, if it has not been yet."""
        keys = self._keys
        if keys is not None and keys[r] is not None:
            self._cpu[r] = torch.Generator().manual_seed(keys[r]).get_state()
            keys[r] = None

    # --- switching ------------------------------------------------------------------------
    def put(self, r: int) -> None:
        """Makes replica ``r``'s stream the one in force on the CPU (and its GPU)."""
        keys = self._keys
        if keys is not None and keys[r] is not None:  # keyed: the state a fresh generator of that seed has
            torch.default_generator.manual_seed(keys[r])
            keys[r] = None
        else:
            torch.default_generator.set_state(self._cpu[r])
        generator = self._accelerators[r]
        if generator is not None:
            generator.set_state(self._gpu[r])

    def take(self, r: int) -> None:
        """Keeps the state replica ``r``'s stream has advanced to (it is no longer in force)."""
        self._cpu[r] = torch.default_generator.get_state()
        generator = self._accelerators[r]
        if generator is not None:
            self._gpu[r] = generator.get_state()

    def host_state(self) -> tuple:
        """The generator states in force outside the replicas, to give back with ``restore``."""
        gpu = tuple(None if g is None else g.get_state() for g in self._accelerators)
        return torch.default_generator.get_state(), gpu

    def restore(self, host: tuple) -> None:
        cpu, gpu = host
        torch.default_generator.set_state(cpu)
        for generator, saved in zip(self._accelerators, gpu):
            if generator is not None:
                generator.set_state(saved)

    def snapshot(self) -> tuple:
        """The streams as they are now, for ``rewind`` (states are replaced, never changed in place; seeds ``key``
        gave and no ``put`` used yet are kept as seeds); None before they are seeded."""
        if self._cpu is None:
            return None
        return list(self._cpu), list(self._gpu), None if self._keys is None else list(self._keys)

    def rewind(self, snapshot) -> None:
        if snapshot is not None:
            cpu, gpu, keys = snapshot
            self._cpu, self._gpu, self._keys = list(cpu), list(gpu), None if keys is None else list(keys)

    # --- threads --------------------------------------------------------------------------
    @contextlib.contextmanager
    def on_thread(self, r: int):
        """Replica ``r``'s stream in force on a thread of its own, replicas running side by side: its
        GPU's generator is its own (draws routed to its stream when logical GPUs share the physical
        one); CPU draws are routed to its stream when every replica is on the CPU (replicas on GPUs
        draw on the CPU from the generator the threads share)."""
        self._settle(r)
        generator = None if self._shared[r] else self._accelerators[r]
        if generator is not None:
            generator.set_state(self._gpu[r])
        try:
            if self._route_cpu or self._shared[r]:
                shared = self._accelerators[r] if self._shared[r] else None
                with _RoutedDraws(self, r, cpu=self._route_cpu, gpu=shared):
                    yield
            else:
                yield
        finally:
            if generator is not None:
                self._gpu[r] = generator.get_state()

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"seed": base seed, "cpu": [state per local replica], "gpu": [...]}`` (CPU tensors)."""
        self.ensure_seeded()
        for r in range(len(self._cpu)):  # (every keyed state made)
            self._settle(r)
        return {
            "seed": self.base_seed,
            "cpu": [s.clone() for s in self._cpu],
            "gpu": [None if s is None else s.clone() for s in self._gpu],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores ``state_dict()`` output of as many replicas (a GPU state only onto a GPU replica)."""
        if len(state["cpu"]) != len(self._devices):
            raise ValueError(
                f"The saved random streams are of {len(state['cpu'])} replicas; this worker has {len(self._devices)}."
            )
        self._cpu, self._keys = [s.clone() for s in state["cpu"]], None
        saved_gpu = state.get("gpu") or [None] * len(self._devices)
        gpu = []
        for r, generator in enumerate(self._accelerators):
            if generator is None:
                gpu.append(None)
            elif saved_gpu[r] is not None:
                gpu.append(saved_gpu[r].clone())
            else:  # saved from a CPU replica: a GPU stream of its own from the same seed
                gpu.append(_seeded_state(generator, replica_seed(int(state["seed"]), self._first + r)))
        self._gpu = gpu
        self.base_seed = state["seed"]

    def resume(self, state: dict | None, seed: int, salt: tuple = ()) -> None:
        """Streams for a run resumed from ``state`` (``state_dict()`` output of *every* replica of the saver,
        in global replica order; ``None`` where the saver had no streams: the default strategy), with any
        number of replicas: a replica whose global id the saver had continues that replica's stream; a
        replica that did not exist before starts a stream of its own seeded from ``(the saved seed, else
        seed, its global id, *salt)`` (``salt``: where the run resumes, e.g. its epoch and step), distinct
        from every other and from the start of the run. A GPU replica whose saved stream has no GPU state
        gets one from the replica's seed, as in ``load_state_dict``. A ``None`` stream (a replica of a worker that
        died before a survivor wrote the backup) counts as a replica the saver did not have.

        Example::

            streams.resume(saved, saved["seed"], salt=(epoch, step))  # saved by 2 replicas, resumed on 3
        """
        saved_cpu = list(state["cpu"]) if state else []
        saved_gpu = list(state.get("gpu") or [None] * len(saved_cpu)) if state else []
        base = int(state["seed"]) if state else int(seed)
        cpu, gpu = [], []
        for r, generator in enumerate(self._accelerators):
            global_id = self._first + r
            if global_id < len(saved_cpu) and saved_cpu[global_id] is not None:
                cpu.append(saved_cpu[global_id].clone())
                known = saved_gpu[global_id] if global_id < len(saved_gpu) else None
                if generator is None:
                    gpu.append(None)
                else:
                    own = known.clone() if known is not None else None
                    gpu.append(own if own is not None else _seeded_state(generator, replica_seed(base, global_id)))
                continue
            value = replica_seed(base, global_id, *salt)
            cpu.append(torch.Generator().manual_seed(value).get_state())
            gpu.append(None if generator is None else _seeded_state(generator, value))
        self._cpu, self._gpu, self._keys, self.base_seed = cpu, gpu, None, base


def _random_functions() -> frozenset:
    """torch's functions that draw from the CPU generator when given CPU tensors (see the module docstring)."""
    F = torch.nn.functional
    names = [
        (torch, "rand"), (torch, "rand_like"), (torch, "randn"), (torch, "randn_like"), (torch, "randint"),
        (torch, "randint_like"), (torch, "randperm"), (torch, "bernoulli"), (torch, "multinomial"),
        (torch, "normal"), (torch, "poisson"), (torch, "binomial"), (torch, "dropout"), (torch, "alpha_dropout"),
        (torch, "feature_dropout"), (torch, "feature_alpha_dropout"), (torch, "rrelu"), (torch, "rrelu_"),
        (F, "dropout"), (F, "dropout1d"), (F, "dropout2d"), (F, "dropout3d"), (F, "alpha_dropout"),
        (F, "feature_alpha_dropout"), (F, "rrelu"), (F, "gumbel_softmax"), (F, "scaled_dot_product_attention"),
        (F, "multi_head_attention_forward"),
        (torch.Tensor, "uniform_"), (torch.Tensor, "normal_"), (torch.Tensor, "bernoulli_"),
        (torch.Tensor, "bernoulli"), (torch.Tensor, "random_"), (torch.Tensor, "exponential_"),
        (torch.Tensor, "geometric_"), (torch.Tensor, "log_normal_"), (torch.Tensor, "cauchy_"),
        (torch.Tensor, "multinomial"),
    ]  # fmt: skip
    found = set()
    for owner, name in names:
        function = getattr(owner, name, None)
        if function is not None:
            found.add(function)
    return frozenset(found)


_RANDOM = None
_draw_lock = threading.Lock()  # one CPU draw at a time across replica threads


class _RoutedDraws(torch.overrides.TorchFunctionMode):
    """Swaps replica ``replica``'s stream into the generators the threads share (the CPU's with
    ``cpu``, the GPU generator ``gpu``) around each of torch's random functions, one draw at a time."""

    def __init__(self, streams: ReplicaStreams, replica: int, cpu: bool = True, gpu=None):
        super().__init__()
        global _RANDOM
        if _RANDOM is None:
            _RANDOM = _random_functions()
        self._streams, self._replica, self._cpu, self._gpu = streams, replica, cpu, gpu

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RANDOM:
            return func(*args, **kwargs)
        with _draw_lock:
            streams, r, gpu = self._streams, self._replica, self._gpu
            outer = torch.default_generator.get_state() if self._cpu else None
            outer_gpu = gpu.get_state() if gpu is not None else None
            if self._cpu:
                torch.default_generator.set_state(streams._cpu[r])
            if gpu is not None:
                gpu.set_state(streams._gpu[r])
            try:
                return func(*args, **kwargs)
            finally:
                if self._cpu:
                    streams._cpu[r] = torch.default_generator.get_state()
                    torch.default_generator.set_state(outer)
                if gpu is not None:
                    streams._gpu[r] = gpu.get_state()
                    gpu.set_state(outer_gpu)
