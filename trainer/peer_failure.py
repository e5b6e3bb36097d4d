"""Saving on a peer's failure: when another worker dies or stops arriving, a survivor writes the backup of the
last step every worker finished, so the restarted run repeats no step (``BackupAndRestore(save_on_peer_failure=
True)``, the default).

Under ``MultiWorkerMirroredStrategy`` without sharding every worker holds the whole model and optimizer state.
A collective that fails because a peer died raises ``WorkerFailedError`` on every survivor; a step's update is
applied only once its gradient reduction completed, and a reduction that completed on any worker carried every
worker's gradients. So each survivor holds the state after the last step whose update it applied, and that
state is the run's own: the same weights, optimizer slots and data position on every worker that got there.
``fit`` knows where the failure came (``FitLoop`` keeps a ``Point`` as it goes):

* **inside a training step**, before its update (the usual case: the gradient reduction, or the input's
  agreement): the backup of the steps before it, the random streams, the data position and what the step's
  forward changed (per-replica BatchNorm statistics, several outputs' loss trackers) put back where the step
  began (the failed step is trained once, after the restart);
* **after a step's update**, in the read of its logs: the step's ``on_train_batch_end`` runs on this
  worker with its own replicas' logs, then the backup of the steps up to it; in a callback's hook: only where
  that callback is the ``BackupAndRestore`` saving (every other callback ran), else no backup;
* **after an epoch's training steps** (its last window applied, the logs, validation): the backup of the
  epoch's training steps, the random streams and metric accumulators put back as they were (validation
  runs again, as after a preemption); inside ``on_epoch_end`` as inside a step's hook; after it, the backup
  of the finished epoch;
* **before the first step**, **inside a gradient-accumulation window** (the dead worker's sums are gone; a
  window's last step closes it before its reduction, so a failure there leaves neither window nor update) and
  **under sharded states** (``FullyShardedStrategy``, ``shard_optimizer_states=True``: the dead
  worker's part is gone): no backup; the last periodic backup stands, and the error says why.

**Which survivor writes.** The survivors cannot talk through the process group any more, and with the
launcher its store lived in worker 0. They meet in ``backup_dir`` instead, the storage every worker sees:
each writes a small file with how far it got, waits until every other possible survivor wrote one (at most
``SETTLE_SECONDS``), and the one that got furthest (then the lowest rank) takes the decision file and
writes the backup, alone (``cluster.alone()``: the survivor reads its own state through the code that reads
it across workers). A survivor that arrives after the decision writes nothing. Survivors stand at the same
step unless the failure came as a reduction completed on some of them: then the furthest writes, and if it
arrived late the written backup is one step earlier (that step is trained again, exactly).

**What the writer cannot know.** It writes what it holds; the rest was on the other workers: the epoch's
training metrics count the writer's rows before the failure (every row after it); the other replicas (the
dead worker's, another survivor's) start streams seeded from (seed, global replica id, epoch, step), as new
replicas do on a resume on more workers, and every worker's torch generator resumes from the writer's;
per-replica BatchNorm statistics resume from the writer's; callbacks whose state the chief alone keeps
(``CSVLogger``, trackers) get the last backup's state when the chief is the worker lost. Weights, optimizer
slots, the data position and what the failed step's forward changed (put back) are exact.

Every survivor then raises ``WorkerFailedError`` again, saying what was written (exit status 69 under
``replicafit fit``: "a peer failed; restart to resume"), and the launcher's ``--max-restarts``, torchrun's
agent or a scheduler starts the workers again, which resume from the backup.

Example::

    backup = BackupAndRestore("/shared/run/backup")   # save_on_peer_failure=True
    trainer.fit(model, data, epochs=10, callbacks=[backup])   # a peer dies: a survivor writes the backup
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

__all__ = ["SETTLE_SECONDS", "Point", "claim", "claims_folder"]

#: How long a survivor waits for the other survivors' notes before the furthest is chosen.
SETTLE_SECONDS = 2.0
_POLL_SECONDS = 0.02
_DECISION = "decided"


@dataclasses.dataclass
class Point:
    """Where a fit stands, for a save after a peer's failure (``FitLoop`` moves it on).

    ``phase``: ``"step"`` (a training step began: ``snapshot`` holds what it may change before its update),
    ``"applied"`` (its update applied, its logs not read), ``"hooks"`` (its ``on_train_batch_end`` runs),
    ``"agreed"`` (its hooks ran), ``"epoch"`` (the epoch's training steps are done: ``snapshot`` holds what
    validation may change), ``"epoch_hooks"`` (``on_epoch_end`` runs, with ``logs``), ``"done"`` (the epoch
    ended). ``epoch`` and ``step``: the epoch and its training steps done at that point.
    """

    phase: str
    epoch: int
    step: int
    snapshot: object = None
    logs: dict | None = None
    window: bool = False  # ("epoch") the optimizer's open accumulation window is being applied

    @property
    def progress(self) -> tuple:
        """``(epoch, steps, finished)``: ordered as the run goes on."""
        return (self.epoch, self.step, int(self.phase in ("epoch_hooks", "done")))


def claims_folder(backup_dir: str, token: str) -> str:
    """The folder where the survivors of one fit's cluster meet (``token``: the chief's, the same on every
    worker of that fit)."""
    return os.path.join(backup_dir, f".peer-failure-{token}")


def claim(folder: str, rank: int, progress: tuple, survivors: int, settle_seconds: float = SETTLE_SECONDS) -> bool:
    """Whether this worker writes the backup after a peer's failure: it notes ``progress`` in ``folder``, waits
    for the notes of the ``survivors - 1`` others (at most ``settle_seconds``), and takes the decision when its
    progress is the furthest (then its rank the lowest). No communication but files; every wait is bounded.

    Example::

        if claim(claims_folder(backup_dir, token), rank=1, progress=(0, 12, 0), survivors=1):
            ...  # write the backup
    """
    os.makedirs(folder, exist_ok=True)
    note = os.path.join(folder, f"worker-{rank}.json")
    temporary = f"{note}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        json.dump({"rank": rank, "progress": list(progress)}, file)
    os.replace(temporary, note)
    decision = os.path.join(folder, _DECISION)
    deadline = time.monotonic() + settle_seconds
    while True:
        if os.path.exists(decision):
            return False
        notes = _notes(folder)
        if len(notes) >= survivors or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_SECONDS)
    furthest = max(notes, key=lambda n: (tuple(n["progress"]), -n["rank"]))
    if furthest["rank"] != rank:
        return False
    try:
        handle = os.open(decision, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(handle, "w") as file:
        file.write(str(rank))
    return True


def _notes(folder: str) -> list:
    found = []
    for name in os.listdir(folder):
        if name.startswith("worker-") and name.endswith(".json"):
            try:
                with open(os.path.join(folder, name)) as file:
                    found.append(json.load(file))
            except (OSError, ValueError):  # (being replaced: read at the next poll)
                continue
    return found
