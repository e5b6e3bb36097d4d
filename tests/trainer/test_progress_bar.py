"""The progress display as a terminal shows it: run on a pseudo-terminal 80 and 120 columns wide, every
metric of every epoch line (validation included) is shown in full, no line is wider than the terminal,
and the bar keeps Keras' width; ``verbose=2`` prints one complete line per epoch."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch

from replicafit.trainer import ProgbarLogger, Trainer
from replicafit.trainer.callbacks.progbar_logger import format_value as _format_value

CHILD = os.path.join(os.path.dirname(__file__), "progbar_child.py")


def run_on_a_terminal(columns: int, tmp_path) -> tuple:
    """``(the lines as the terminal ends up showing them, the history)``."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["OMP_NUM_THREADS"] = "1"
    history_path = tmp_path / "history.json"
    child = subprocess.Popen(
        [sys.executable, CHILD, str(history_path)], stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True
    )
    os.close(slave)
    output, deadline = b"", time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if child.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(master)
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
    assert child.returncode == 0, output.decode(errors="replace")
    # a line redrawn with carriage returns shows its last drawing (each drawing pads over the one before)
    lines = [line.split("\r")[-1] for line in output.decode().replace("\r\n", "\n").split("\n")]
    return [line for line in lines if line.strip()], json.loads(history_path.read_text())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("columns", [80, 120])
def test_every_metric_shows_in_full_at_80_and_120_columns(columns, tmp_path):
    lines, history = run_on_a_terminal(columns, tmp_path)
    assert all(len(line) < columns for line in lines), [len(line) for line in lines]
    starts = [i for i, line in enumerate(lines) if line.startswith("Epoch ")]
    assert len(starts) == 2
    for epoch, start in enumerate(starts):
        end = starts[epoch + 1] if epoch + 1 < len(starts) else len(lines)
        shown = " ".join(lines[start + 1 : end])
        for name, values in history.items():
            assert f"{name}: {_format_value(values[epoch])}" in shown, (name, shown)
        assert "━" * 20 in lines[start + 1]  # Keras' bar width, not squeezed by the metrics


def test_verbose_2_prints_one_complete_line_per_epoch():
    torch.manual_seed(0)
    x, y = torch.randn(64, 6), torch.randint(0, 2, (64,))
    stream = io.StringIO()
    trainer = Trainer(metrics=["accuracy", "crossentropy"], seed=0)
    history = trainer.fit(
        torch.nn.Linear(6, 2),
        (x, y),
        batch_size=16,
        epochs=2,
        validation_split=0.25,
        verbose=0,
        callbacks=[ProgbarLogger(2, stream=stream)],
    )
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    for epoch, line in enumerate(lines):
        for name, values in history.history.items():
            assert f"{name}: {_format_value(values[epoch])}" in line


def test_values_keep_significant_digits():
    assert _format_value(0.97491) == "0.9749"
    assert _format_value(3e-5) == "3.0000e-05"
    assert _format_value(0.0) == "0.0000"
