"""Torch's thread-local state, which every replica carries as its own.

Grad mode, inference mode, autocast and the default device are per thread in torch. A replica
runs under the state of the thread that called ``strategy.run``, whichever thread or greenlet
runs it, and what it changes stays its own. ``capture_torch_state`` (on the caller's thread)
and ``torch_state`` (where the replica runs) put the caller's state, and the replica's CUDA
device, in force for one call; where replicas take turns on one thread (``cooperative.py``),
``_snapshot`` and ``_put_in_force`` swap each replica's state in and out at every switch.
``_autocast_nesting`` and ``_close_autocast_regions`` let the runner close autocast regions a
replica entered and never left. Only torch is used here.

torch keeps part of this state behind private calls only (``torch._C``: the torch-function mode
stack, inference mode's guard, the grad-mode setter without a context manager, whether any
autocast is on): a replica that takes turns on one thread must save and restore exactly what torch
keeps per thread, so those calls are used here, and nowhere else.
"""

from __future__ import annotations

import contextlib

import torch


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _autocast_dtype(device_type: str):
    getter = getattr(torch, "get_autocast_dtype", None)
    if getter is not None:
        return getter(device_type)
    return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def _default_device() -> torch.device:
    getter = getattr(torch, "get_default_device", None)
    return getter() if getter is not None else torch.device("cpu")


def capture_torch_state() -> tuple:
    """Grad mode, inference mode, autocast state and default device of the calling thread."""
    autocast = tuple((d, _autocast_dtype(d)) for d in ("cpu", "cuda") if _autocast_enabled(d))
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, _default_device())


@contextlib.contextmanager
def torch_state(state: tuple, device: torch.device, current: tuple):
    """Puts ``state`` and the replica's CUDA device in force on this thread for the block.

    ``state`` is what ``capture_torch_state`` returned on the caller's thread.

    Every part that differs from ``current`` (the thread's actual state) is set, so
    state a previous task left behind on a persistent thread never leaks into this one.
    """
    with contextlib.ExitStack() as stack:
        if state != current:
            grad, inference, autocast, default_device = state
            if default_device != current[3]:
                # A GPU default means the replica's own GPU, as TensorFlow places ops on the replica device.
                stack.enter_context(torch.device(device if default_device.type == device.type else default_device))
            if inference != current[1]:
                stack.enter_context(torch.inference_mode(inference))
            stack.enter_context(torch.set_grad_enabled(grad))
            wanted, present = dict(autocast), dict(current[2])
            for device_type in ("cpu", "cuda"):
                if wanted.get(device_type) != present.get(device_type):
                    if device_type in wanted:
                        stack.enter_context(torch.autocast(device_type, dtype=wanted[device_type]))
                    else:
                        stack.enter_context(torch.autocast(device_type, enabled=False))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield


def _autocast_nesting() -> int:
    """How many autocast regions are open on this thread (torch offers only increment/decrement)."""
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _close_autocast_regions(depth: int) -> None:
    """Closes autocast regions opened on this thread since it had ``depth`` of them and never closed
    (a replica that called ``autocast().__enter__()`` alone), clearing the cast cache as leaving the
    last region does. Left open, the cache would keep serving the first step's casts of weights that
    have since been updated in place: later autocast forwards would use stale weights."""
    current = _autocast_nesting()
    if current <= depth:
        return
    while current > depth:
        current = torch.autocast_decrement_nesting()
    if current == 0:
        torch.clear_autocast_cache()


# --- switching replicas on one thread ---------------------------------------------------


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)  # private: one call for every autocast flag


def _snapshot() -> tuple:
    """The thread-local torch state a replica carries across a switch (cheap when it is plain):
    grad mode, inference mode, autocast (per device type), torch function modes (the default
    device is one)."""
    autocast = None
    if _any_autocast is None or _any_autocast():
        autocast = tuple((d, _autocast_enabled(d), _autocast_dtype(d)) for d in ("cpu", "cuda"))
    depth = torch._C._len_torch_function_stack()  # private: the function-mode stack has no public reader
    stack_at = torch._C._get_function_stack_at  # private: the function-mode stack has no public reader
    modes = tuple(stack_at(i) for i in range(depth)) if depth else ()
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, modes)


def _put_in_force(wanted: tuple, current: tuple):
    """Makes ``wanted`` (a ``_snapshot``) the thread's state; returns an inference-mode guard to
    exit when the replica is switched out (or None)."""
    guard = None
    if wanted[1] != current[1]:
        guard = torch._C._InferenceMode(wanted[1])  # private: the guard torch.inference_mode enters
        guard.__enter__()
    if wanted[0] != torch.is_grad_enabled():
        torch._C._set_grad_enabled(wanted[0])  # private: the switch torch.no_grad flips, without its wrapper
    if wanted[2] != current[2]:
        for device_type, enabled, dtype in wanted[2] or (("cpu", False, None), ("cuda", False, None)):
            with contextlib.suppress(RuntimeError, TypeError):  # a device type this build lacks
                if dtype is not None:
                    torch.set_autocast_dtype(device_type, dtype)
                torch.set_autocast_enabled(device_type, enabled)
    if wanted[3] != current[3]:
        # private: torch has no public way to swap a thread's function-mode stack (the default device is a mode)
        for _ in range(torch._C._len_torch_function_stack()):  # private: see the comment above
            torch._C._pop_torch_function_stack()  # private: see the comment above
        for mode in wanted[3]:
            torch._C._push_on_torch_function_stack(mode)  # private: see the comment above
    return guard
