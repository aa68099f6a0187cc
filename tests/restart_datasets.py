"""Datasets that kill the process reading them, for the tests of ``worker_restarts``
(importable by spawned workers). Each death is forced: a dataset kills its own process
at a chosen index, the first time only (a marker file says it happened) unless it is a
poison sample, which kills every process that reads it."""

import os
import random
import signal
import time

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def die_once(marker):
    """SIGKILL this process unless ``marker`` exists (it is made first)."""
    if marker is None or os.path.exists(marker):
        return
    with open(marker, "w"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)


class Draws(Dataset):
    """Each sample draws from random, torch and numpy; index ``kill_at`` kills its process
    the first time (``marker``), or every time with ``poison``."""

    def __init__(self, n=48, kill_at=-1, marker=None, poison=False, size=0, armed=None, seconds=0.0):
        self.n, self.kill_at, self.marker, self.poison, self.size = n, kill_at, marker, poison, size
        self.armed = armed  # a path: the kill happens only once this file exists (a later epoch)
        self.seconds = seconds  # the work of one sample (a decode, say)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.kill_at and (self.armed is None or os.path.exists(self.armed)):
            if self.poison:
                os.kill(os.getpid(), signal.SIGKILL)
            die_once(self.marker)
        if self.seconds:
            time.sleep(self.seconds)
        drawn = torch.tensor([i, random.random(), float(torch.rand(())), float(np.random.rand())], dtype=torch.float64)
        if self.size:  # a large sample: batches of them are lent by the worker
            return torch.full((self.size,), float(i), dtype=torch.float64), drawn
        return drawn


class DrawsIterable(IterableDataset):
    """Each worker yields its share of range(n) (every num_workers-th), with a draw from
    torch's generator; element ``kill_at`` kills its process the first time."""

    def __init__(self, n=40, kill_at=-1, marker=None):
        self.n, self.kill_at, self.marker = n, kill_at, marker

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            if i == self.kill_at:
                die_once(self.marker)
            yield torch.tensor([float(i), float(torch.rand(()))], dtype=torch.float64)


class DiesInInit:
    """A worker_init_fn that kills worker ``worker`` the first time (``marker``), then draws."""

    def __init__(self, worker, marker):
        self.worker, self.marker = worker, marker

    def __call__(self, worker_id):
        if worker_id == self.worker:
            die_once(self.marker)
        random.random()


class ChainedKills(Dataset):
    """Plain samples; each (index, marker) of ``kills`` kills its process the first time."""

    def __init__(self, kills, n=48):
        self.kills, self.n = dict(kills), n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.kills:
            die_once(self.kills[i])
        return i


class KillAt:
    """A DataPipe map function: item ``value`` kills its process the first time (``marker``)."""

    def __init__(self, value, marker):
        self.value, self.marker = value, marker

    def __call__(self, x):
        if x == self.value:
            die_once(self.marker)
        return x * 10 + random.randrange(10)


class LogsReads(Draws):
    """``Draws`` that notes every index it reads in a file of the reading process's own."""

    def __init__(self, folder, **kwargs):
        super().__init__(**kwargs)
        self.folder = folder

    def __getitem__(self, i):
        with open(os.path.join(self.folder, f"reads-{os.getpid()}"), "a") as log:
            log.write(f"{i}\n")
        return super().__getitem__(i)


class CountsReads(LogsReads):
    """``LogsReads`` whose samples also say how many samples its replica had read before
    them: its state (``state_dict()``), which a replacement must load to make the same."""

    def __init__(self, folder, **kwargs):
        super().__init__(folder, **kwargs)
        self.reads = 0

    def __getitem__(self, i):
        drawn = super().__getitem__(i)
        self.reads += 1
        return torch.cat([drawn, torch.tensor([float(self.reads)], dtype=torch.float64)])

    def state_dict(self):
        return {"reads": self.reads}

    def load_state_dict(self, state):
        self.reads = state["reads"]


class Reads(Draws):
    """``CountsReads``'s samples, for the uninterrupted run: each says how many samples the
    replica had read before it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.reads = 0

    def __getitem__(self, i):
        drawn = super().__getitem__(i)
        self.reads += 1
        return torch.cat([drawn, torch.tensor([float(self.reads)], dtype=torch.float64)])


class KillsEvery:
    """A DataPipe map function: item ``value`` kills every process that makes it."""

    def __init__(self, value):
        self.value = value

    def __call__(self, x):
        if x == self.value:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class CountsWithState(IterableDataset):
    """Each worker yields its share of range(n) (every num_workers-th) with a draw from
    torch's generator; its state is how far into its share it is. Every element it makes is
    noted in a file of the making process's own (``folder``), and element ``kill_at``
    kills its process the first time (``marker``), as does each (element, marker) of ``kills``."""

    def __init__(self, n, folder=None, kill_at=-1, marker=None, kills=()):
        self.n, self.folder, self.kill_at, self.marker = n, folder, kill_at, marker
        self.kills = dict(kills)
        self.taken = 0
        self.loaded = None

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        self.taken, self.loaded = self.loaded or 0, None
        log = None if self.folder is None else open(os.path.join(self.folder, f"made-{os.getpid()}"), "a")
        try:
            while start + step * self.taken < self.n:
                value = start + step * self.taken
                self.taken += 1
                if log is not None:
                    log.write(f"{value}\n")
                    log.flush()
                if value == self.kill_at:
                    die_once(self.marker)
                elif value in self.kills:
                    die_once(self.kills[value])
                yield torch.tensor([float(value), float(torch.rand(()))], dtype=torch.float64)
        finally:
            if log is not None:
                log.close()
        self.taken = 0

    def state_dict(self):
        return {"taken": self.taken}

    def load_state_dict(self, state):
        self.loaded = state["taken"]


class LargeState(CountsWithState):
    """``CountsWithState`` whose state carries 100 KiB besides: more than a record holds."""

    def state_dict(self):
        return {**super().state_dict(), "padding": bytes(100 << 10)}
class NotesDealt:
    """A DataPipe map function of the dispatch segment: writes the latest item it made to
    ``path`` (replaced whole, so a reader never sees half a number), and a letter to
    ``path + ".epochs"`` at each epoch's first item."""

    def __init__(self, path):
        self.path = path

    def __call__(self, x):
        if self.path is not None:
            if x == 0:
                with open(self.path + ".epochs", "a") as log:
                    log.write("e")
            with open(self.path + ".new", "w") as note:
                note.write(str(x))
            os.replace(self.path + ".new", self.path)
        return x


class KillOnceDealt(KillAt):
    """``KillAt`` whose item ``value`` first waits (60 s at most) until the dispatch process
    has made item ``dealt`` (``NotesDealt``), and notes in ``marker + ".saw"`` that it did:
    the kill then comes while the dispatcher is sending to this worker's full channel."""

    def __init__(self, value, marker, notes, dealt):
        super().__init__(value, marker)
        self.notes, self.dealt = notes, dealt

    def __call__(self, x):
        if x == self.value and self.marker is not None and not os.path.exists(self.marker):
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                try:
                    with open(self.notes) as note:
                        made = int(note.read())
                except (OSError, ValueError):
                    made = -1
                if made >= self.dealt:
                    with open(self.marker + ".saw", "w"):
                        pass
                    break
                time.sleep(0.001)  # a re-check of a condition, bounded by the deadline
        return super().__call__(x)


class ChainedKillsMap:
    """A DataPipe map function: each (item, marker) of ``kills`` kills its process the first time."""

    def __init__(self, kills):
        self.kills = dict(kills)

    def __call__(self, x):
        if x in self.kills:
            die_once(self.kills[x])
        return x


class KillsInEpoch(KillAt):
    """``KillAt`` that kills only in the second epoch, as counted in ``epochs`` (written by
    ``NotesDealt`` in the dispatch process before it deals the epoch's first item)."""

    def __init__(self, value, marker, epochs):
        super().__init__(value, marker)
        self.epochs = epochs

    def __call__(self, x):
        if x == self.value:
            with open(self.epochs) as log:
                if len(log.read()) != 2:
                    return x * 10 + random.randrange(10)
        return super().__call__(x)


class KillOnceArmed(KillAt):
    """``KillAt`` that kills only once the file ``armed`` exists (a restored run)."""

    def __init__(self, value, marker, armed):
        super().__init__(value, marker)
        self.armed = armed

    def __call__(self, x):
        if x == self.value and not os.path.exists(self.armed):
            return x * 10 + random.randrange(10)
        return super().__call__(x)


class PoisonOnceReached(Draws):
    """``Draws`` whose index ``kill_at`` kills every process that reads it (``poison``), but
    only once ``reached`` exists: the loop makes it when it has the batches before the
    poison one, so the first death comes with all of them received. A bounded wait."""

    def __init__(self, reached, **kwargs):
        super().__init__(poison=True, **kwargs)
        self.reached = reached

    def __getitem__(self, i):
        if i == self.kill_at:
            deadline = time.monotonic() + 60.0
            while not os.path.exists(self.reached) and time.monotonic() < deadline:
                time.sleep(0.01)  # the file is the loop's word; nothing to be woken by across processes
        return super().__getitem__(i)


def _stopped_clock():
    return 0.0


class InWorkers:
    """A worker_init_fn that sets the runtime's knobs in the process it runs in (a Ray actor
    cannot be monkeypatched from the test): how often records are taken (``record_seconds``),
    a stopped batching clock (a small batch then leaves only when the worker flushes), and
    a death of worker ``dies`` in it the first time (``marker``). Draws nothing."""

    def __init__(self, record_seconds=None, stopped_clock=False, dies=-1, marker=None):
        self.record_seconds, self.stopped_clock, self.dies, self.marker = record_seconds, stopped_clock, dies, marker

    def __call__(self, worker_id):
        from mprs_plus.runtime import generators
        from mprs_plus.runtime.child import batching

        if self.record_seconds is not None:
            generators.RECORD_SECONDS = self.record_seconds
        if self.stopped_clock:
            batching._clock = _stopped_clock
        if worker_id == self.dies and self.marker is not None:
            die_once(self.marker)


def collate_with_a_draw(samples):
    """Collates, and draws from torch's generator as a collator that masks at random does."""
    return torch.utils.data.default_collate(samples), torch.rand(len(samples))


def read_through(loader, plain, after=None):
    """Iterate ``loader`` to its end, going on after a batch that raised, as a loop that
    skips a bad batch does: the batches (``plain`` of each, None where ``next()`` raised)
    and the errors. ``after(got)`` runs once each batch is in ``got``."""
    got, errors = [], []
    iterator = iter(loader)
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return got, errors
        except RuntimeError as exc:
            errors.append(exc)
            got.append(None)
            continue
        got.append(plain(batch))
        if after is not None:
            after(got)


def killed_in_epoch_two(marker, armed, plain, **options):
    """Three epochs of a ``mprs_plus.DataLoader`` of persistent workers over ``Draws``
    whose index 18 kills its reader once, from epoch 2 on (``armed``, a path, is touched
    after epoch 1): each epoch's batches (``plain`` of each), and the loader."""
    import mprs_plus

    torch.manual_seed(0)
    loader = mprs_plus.DataLoader(
        Draws(kill_at=18, marker=marker, armed=str(armed)),
        batch_size=4,
        num_workers=2,
        persistent_workers=True,
        worker_restarts=1,
        **options,
    )
    got = [[plain(b) for b in loader]]
    armed.touch()  # from now on index 18 kills, once
    got.append([plain(b) for b in loader])
    got.append([plain(b) for b in loader])
    return got, loader


class Dies:
    """Made a Ray actor by a test: ``die()`` kills its process, for a call to a dead actor."""

    def pid(self):
        return os.getpid()

    def die(self):
        os.kill(os.getpid(), signal.SIGKILL)
