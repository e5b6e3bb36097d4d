"""``ProgbarLogger``: Keras' progress display, with the bar line's layout and the formatting of its values."""

from __future__ import annotations

import math
import os
import shutil
import sys
import time

from .callback import Callback


def format_value(value) -> str:
    """Keras' rule: 4 decimals, or 4 significant digits in scientific notation below 1e-3 (a learning
    rate of 3e-5 stays readable).

    Example::

        format_value(0.97491), format_value(3e-5)   # ('0.9749', '3.0000e-05')
    """
    if isinstance(value, float):
        return f"{value:.4f}" if value == 0 or abs(value) >= 1e-3 or not math.isfinite(value) else f"{value:.4e}"
    return str(value)


def _format_logs(logs: dict) -> str:
    return " - ".join(f"{k}: {format_value(v)}" for k, v in logs.items())


def _log_items(logs) -> list:
    return [f"{k}: {format_value(v)}" for k, v in (logs or {}).items() if isinstance(v, (float, int))]


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"
    if seconds >= 60:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
    return f"{seconds:.0f}s"


def _per_step(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.1f}s/step"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.0f}ms/step"
    return f"{seconds * 1e6:.0f}us/step"


class ProgbarLogger(Callback):
    """Keras' progress display: ``verbose=1`` draws a tqdm bar per epoch on a terminal, ``verbose=2``
    prints one complete line per epoch, ``0`` nothing; ``"auto"``: 1 on a terminal, else 2.

    The bar line is laid out as Keras' (``12/23 ━━━━━━━━━━━━━━━━━━━━ 1s 3ms/step - loss: 0.2053 -
    accuracy: 0.9475``) to the terminal's width: the bar gives up columns first (down to 10), then the
    values that do not fit are left out of the line being redrawn, never cut. The epoch's last line
    shows every value, the validation ones included, carrying on over further lines where one line
    is too narrow. On a stream that is not a terminal (a file, a pipe), ``verbose=1`` prints the
    epoch's final lines only. Values have 4 decimals, or 4 significant digits below 1e-3.

    Example::

        trainer.fit(model, data, epochs=3, callbacks=[ProgbarLogger(2, stream=open("log.txt", "w"))], verbose=0)
    """

    leaves_variables_alone = True  # its batch hooks read the logs (and set rates), not variables

    _decides_from_logs = True
    _REDRAW_SECONDS = 0.1
    _BAR = 20  # Keras' bar width, and the narrowest it gets
    _MIN_BAR = 10

    def __init__(self, verbose=1, stream=None):
        super().__init__()
        self.verbose = resolve_verbose(verbose)
        self.stream = stream
        self._bar = None
        self._start = 0.0
        self._seen = 0
        self._drawn = float("-inf")

    def _stream(self):
        return self.stream or sys.stdout

    def _columns(self) -> int:
        """The terminal's width (``COLUMNS``, else 80, where the stream is no terminal)."""
        try:
            return os.get_terminal_size(self._stream().fileno()).columns
        except (AttributeError, OSError, ValueError):
            return shutil.get_terminal_size((80, 24)).columns

    def _wants_logs(self, hook: str) -> bool:
        return self.verbose == 1 and super()._wants_logs(hook)  # only the bar shows per-batch values

    def _wants_logs_now(self, hook: str) -> bool:
        # The bar is redrawn at most every 0.1 s and at the epoch's last step: the values are read
        # then only, not at every step.
        bar = self._bar
        if hook != "on_train_batch_end" or bar is None:
            return False
        return self._redraw_due(self._seen + 1, bar.total)

    def _redraw_due(self, seen: int, total) -> bool:
        return time.perf_counter() - self._drawn >= self._REDRAW_SECONDS or seen == total

    def on_epoch_begin(self, epoch, logs=None):
        """Starts the epoch's clock; with ``verbose=1`` prints ``Epoch i/N`` and, on a terminal, opens the
        epoch's bar (the chief only)."""
        self._start = time.perf_counter()
        self._seen = 0
        self._drawn = float("-inf")  # each epoch's bar is drawn at its first step, as Keras' Progbar is
        if self.verbose == 1 and self._is_chief:
            stream = self._stream()
            print(f"Epoch {epoch + 1}/{self.params.get('epochs')}", file=stream, flush=True)
            if getattr(stream, "isatty", lambda: False)():
                from tqdm.auto import tqdm

                self._bar = tqdm(
                    total=self.params.get("steps"),
                    file=stream,
                    leave=True,
                    ncols=None,
                    dynamic_ncols=False,
                    mininterval=float("inf"),  # redrawn by on_train_batch_end, at most every 0.1 s
                    ascii=" ━",
                    bar_format="{n_fmt}/{total_fmt} {bar:20}{desc}",
                )

    def on_train_batch_end(self, batch, logs=None):
        """Counts the step; with a bar (``verbose=1`` on a terminal) redraws it with the batch logs when a redraw
        is due (at most every 0.1 s, and at the epoch's last step): only then does it ask for the logs
        (``wants_logs_now``)."""
        self._seen += 1
        bar = self._bar
        if bar is None:
            return
        bar.n = self._seen
        if logs and self._redraw_due(self._seen, bar.total):  # logs are read only when a redraw is due
            self._drawn = time.perf_counter()
            self._draw(_log_items(logs), final=False)

    def _timing(self, final: bool) -> str:
        elapsed = time.perf_counter() - self._start
        per_step = elapsed / max(self._seen, 1)
        steps = self.params.get("steps")
        left = 0.0 if final or steps is None else per_step * max(steps - self._seen, 0)
        return f"{_duration(elapsed if final else left)} {_per_step(per_step)}"

    def _counter(self) -> str:
        steps = self.params.get("steps")
        return f"{self._seen}/{steps if steps is not None else '?'}"

    def _layout(self, items: list, timing: str, final: bool) -> tuple:
        """``(bar width, the items on the bar's line, the further lines)`` for this terminal."""
        counter = len(self._counter())
        limit = self._columns() - 1  # a line filling the last column would wrap in some terminals
        room = limit - (counter + 1) - len(" " + timing) - self._MIN_BAR
        first = []
        for item in items:
            if len(" - " + item) > room:
                break
            first.append(item)
            room -= len(" - " + item)
        bar = max(self._MIN_BAR, min(self._BAR, self._MIN_BAR + room))
        rest = items[len(first) :] if final else []
        lines, line, indent = [], "", " " * (counter + 1)
        for item in rest:  # the values that did not fit, over further lines, never cut
            if line and len(line + " - " + item) > limit:
                lines.append(line)
                line = ""
            line = (line + " - " + item) if line else (indent + "- " + item)
        if line:
            lines.append(line)
        return bar, first, lines

    def _draw(self, items: list, final: bool) -> list:
        """Redraws the bar's line; returns the further lines of a final draw."""
        timing = self._timing(final)
        width, first, further = self._layout(items, timing, final)
        text = " " + timing + "".join(" - " + item for item in first)
        bar = self._bar
        if bar is not None:
            bar.n = self._seen
            bar.bar_format = f"{{n_fmt}}/{{total_fmt}} {{bar:{width}}}{{desc}}"
            bar.set_description_str(text, refresh=False)
            bar.refresh()
        else:  # not a terminal: the final line only, the bar full
            utf = (getattr(self._stream(), "encoding", None) or "utf-8").lower().replace("-", "").startswith("utf")
            print(f"{self._counter()} {('━' if utf else '=') * width}{text}", file=self._stream())
        return further

    def on_epoch_end(self, epoch, logs=None):
        """Prints the epoch's final line with every value of the epoch's logs, the validation ones included
        (``verbose=1``: the bar's last draw; ``verbose=2``: one line with the epoch's time)."""
        elapsed = time.perf_counter() - self._start
        if self.verbose == 1 and self._is_chief:
            further = self._draw(_log_items(logs), final=True)
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            for line in further:
                print(line, file=self._stream())
            self._stream().flush()
        elif self.verbose == 2 and self._is_chief:
            print(
                f"Epoch {epoch + 1}/{self.params.get('epochs')} - {elapsed:.1f}s - {_format_logs(logs or {})}",
                file=self._stream(),
                flush=True,
            )

    def on_train_end(self, logs=None):
        """Closes the bar if one is still open."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def resolve_verbose(verbose) -> int:
    if verbose == "auto":
        return 1 if sys.stdout.isatty() else 2
    if verbose not in (0, 1, 2):
        raise ValueError(f"verbose must be 0, 1, 2 or 'auto', got {verbose!r}.")
    return verbose
