"""The main-process side of a running service: starts the processes, opens each epoch,
reads the workers' output in round-robin order, and stops everything.

    main segment <- WorkerReader <- [data channel per worker] <- worker w
                                   [control channel per child] -> dispatch, workers

Every blocking read also watches every child's sentinel, so a dead child is an error
at once, never a hang.
"""

from __future__ import annotations

import multiprocessing
import os
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterDataPipe

from ..errors import ProcessDiedError, ServiceClosedError
from ..options import Options
from ..plan import Plan
from ..transport import ChannelBroken, ChannelError, EndOfStream, open_channel, wait_readable
from .dispatch import DispatchSetup, dispatch_main
from .diagnose import unpicklable_error
from .lifecycle import exit_description, stop_at_exit, stop_processes
from .messages import Kind
from .segments import build_dispatch_source, build_main_pipeline, build_worker_program
from .worker import WorkerSetup, worker_main

# Control messages are small and rare; a few in flight is plenty.
_CONTROL_ITEMS = 4
_CONTROL_BYTES = 1 << 20
_DATA_BYTES = 64 << 20
_DEATH_GRACE = 2.0  # seconds a broken channel's process may take to be reaped


class WorkerReader(IterDataPipe):
    """The main segment's input: the workers' items for the current epoch, round-robin.

    An ``IterDataPipe`` so that DataLoader2 and torch's graph tools accept it as the
    root of the main segment; graph traversal finds nothing behind it.
    """

    def __init__(self, service: ServiceRuntime) -> None:
        self._service = service

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __deepcopy__(self, memo: dict[int, Any]) -> WorkerReader:
        return self  # one reader per service, whatever copies the main segment



def _iterate_reader(reader: WorkerReader) -> Iterator[Any]:
    return reader._service.iterate()


# Assigned after the class is made, on purpose: torch's DataPipe metaclass wraps an
# ``__iter__`` found in the class body with per-item bookkeeping (profiling, iterator
# validity checks) that costs more than the shared-memory transport per item.
WorkerReader.__iter__ = _iterate_reader  # type: ignore[method-assign]


class ServiceResources:
    """Everything a running service must release: its processes and channel endpoints.

    Held by the ``ServiceRuntime`` facade, by its garbage-collection finalizer and by the
    exit hook, and by nothing else, so that dropping the facade can release it.
    """

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.stopped = False
        self.dispatch: Any = None
        self.workers: list[Any] = []
        self.controls: list[Any] = []  # senders to the dispatch process (first, if any) and workers
        self.data: list[Any] = []  # receivers from worker w
        self.epoch = 0
        self._drained: set[int] = set()  # data channels found closed while stopping

    def processes(self) -> list[Any]:
        return ([self.dispatch] if self.dispatch is not None else []) + self.workers

    def stop(self) -> None:
        """Stop every child and close every endpoint. Idempotent; a no-op in a forked child."""
        if self.stopped or os.getpid() != self.owner_pid:
            return
        self.stopped = True
        for control in self.controls:
            try:
                control.send((Kind.STOP, self.epoch, None))
            except ChannelError:
                pass
            control.close()
        stop_processes(self.processes(), drain=self._drain)
        for receiver in self.data:
            receiver.close()

    def _drain(self, timeout: float) -> None:
        """Discard worker output while stopping, so no worker stays blocked on a full channel."""
        open_receivers = [r for i, r in enumerate(self.data) if i not in self._drained]
        alive = {p.sentinel: p for p in self.processes() if p.exitcode is None}
        if not alive:
            return  # everyone exited since the caller looked: nothing left to wait for
        for ready in wait_readable(open_receivers, timeout, also=list(alive)):
            if ready in alive:
                # Its sentinel fired: the process is gone or in its last moments; reap it
                # rather than wake up again and again until the kernel lets us.
                alive[ready].join(_DEATH_GRACE)
                continue
            try:
                while ready.poll():
                    ready.recv(0)
            except ChannelError:
                self._drained.add(self.data.index(ready))


class ServiceRuntime:
    """The running service, as the reading service and the main segment see it.

    It stops on ``stop()``, when it is garbage collected, and at interpreter exit,
    whichever comes first.
    """

    def __init__(self, plan: Plan, options: Options) -> None:
        self.plan = plan
        self.options = options
        self._ctx = multiprocessing.get_context(options.multiprocessing_context)
        self._res = ServiceResources()
        self._finalizer = weakref.finalize(self, self._res.stop)
        stop_at_exit(self._res)

    # -- start ---------------------------------------------------------------------------

    def start(self) -> Any:
        """Start every process; return the main segment, ready to iterate."""
        res, n = self._res, self.options.num_workers
        program = build_worker_program(self.plan)
        source = build_dispatch_source(self.plan)
        main_pipeline = build_main_pipeline(self.plan, WorkerReader(self))
        child_ends: list[Any] = []
        try:
            worker_inputs: list[tuple[Any, ...]] = [() for _ in range(n)]
            if source is not None:
                control_tx, control_rx = self._channel(_CONTROL_ITEMS, _CONTROL_BYTES)
                pairs = [self._channel(max(1, self.options.worker_prefetch_cnt), _DATA_BYTES) for _ in range(n)]
                worker_inputs = [(rx,) for _, rx in pairs]
                setup = DispatchSetup(source, n, control_rx, tuple(tx for tx, _ in pairs))
                child_ends += [control_rx, *(tx for tx, _ in pairs), *(rx for _, rx in pairs)]
                res.controls.append(control_tx)
                res.dispatch = self._start("mprs_plus dispatch process", dispatch_main, setup)
            for worker_id in range(n):
                control_tx, control_rx = self._channel(_CONTROL_ITEMS, _CONTROL_BYTES)
                data_tx, data_rx = self._channel(self.options.items_in_flight_per_worker, _DATA_BYTES)
                setup = WorkerSetup(
                    worker_id=worker_id,
                    num_workers=n,
                    program=program,
                    control=control_rx,
                    data=data_tx,
                    inputs=worker_inputs[worker_id],
                    init_fn=self.options.worker_init_fn,
                    reset_fn=self.options.worker_reset_fn,
                )
                child_ends += [control_rx, data_tx]
                res.controls.append(control_tx)
                res.data.append(data_rx)
                res.workers.append(self._start(f"mprs_plus worker {worker_id}", worker_main, setup))
        except BaseException:
            res.stop()
            raise
        finally:
            for end in child_ends:
                end.release()  # each belongs to a child now
        sentinels = [p.sentinel for p in res.processes()]
        for receiver in res.data:
            receiver.watch(*sentinels)
        return main_pipeline

    def _channel(self, items: int, size: int) -> tuple[Any, Any]:
        return open_channel(self._ctx, capacity_items=items, capacity_bytes=size)

    def _start(self, name: str, target: Any, setup: Any) -> Any:
        process = self._ctx.Process(target=target, args=(setup,), name=name, daemon=True)
        try:
            process.start()
        except Exception as exc:
            if self._ctx.get_start_method() == "fork":
                raise
            raise unpicklable_error(setup, self._ctx.get_start_method(), name) from exc
        return process

    # -- epochs --------------------------------------------------------------------------

    def begin_epoch(self, seed_generator: Any, iter_reset_fn: Any = None) -> None:
        """Open a new epoch everywhere; items of earlier epochs still in flight are dropped."""
        res = self._check_open()
        res.epoch += 1
        controls = list(res.controls)
        try:
            if res.dispatch is not None:
                controls.pop(0).send((Kind.RESET, res.epoch, (seed_generator, iter_reset_fn)))
            for worker_id, control in enumerate(controls):
                control.send((Kind.RESET, res.epoch, (seed_generator.spawn(worker_id), iter_reset_fn)))
        except ChannelError as exc:
            raise self._death_error() from exc

    def iterate(self) -> Iterator[Any]:
        """The current epoch's items: worker 0, 1, ..., N-1, 0, ...; exhausted workers skipped."""
        res = self._check_open()
        epoch = res.epoch
        pending: list[deque[Any]] = [deque() for _ in res.data]
        active = list(range(len(res.data)))
        position = 0
        try:
            while active:
                worker_id = active[position]
                queue = pending[worker_id]
                if queue:
                    yield queue.popleft()
                    position = position + 1 if position + 1 < len(active) else 0
                    continue
                kind, message_epoch, payload = self._recv(worker_id)
                if message_epoch != epoch:
                    continue
                if kind == Kind.ITEMS:
                    queue.extend(payload)
                elif kind == Kind.END:
                    active.pop(position)
                    if position >= len(active):
                        position = 0
                else:
                    raise payload.rebuild()
        except KeyboardInterrupt:
            # Ctrl-C: the children ignore SIGINT and wait for us; end them before unwinding.
            self.stop()
            raise

    def _recv(self, worker_id: int) -> tuple[int, int, Any]:
        timeout = self.options.timeout
        try:
            return self._res.data[worker_id].recv(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"no item from worker {worker_id} within timeout={timeout} s; the workers are alive. "
                "Raise the timeout if items are this slow, or look for a stuck read in the pipeline."
            ) from None
        except (ChannelBroken, EndOfStream) as exc:
            raise self._death_error() from exc
        except ChannelError as exc:
            raise ServiceClosedError("the reading service was shut down during iteration") from exc

    def _death_error(self) -> Exception:
        if self._res.stopped:
            return ServiceClosedError("the reading service was shut down")
        dead = []
        processes = self._res.processes()
        # The channel can break a moment before the process has exited: give it that
        # moment, then reap the ones whose sentinel fired (they are gone or going).
        ready = wait_readable([], _DEATH_GRACE, also=[p.sentinel for p in processes])
        for process in processes:
            process.join(None if process.sentinel in ready else 0)
            if process.exitcode is not None:
                dead.append(f"{process.name} (pid {process.pid}) {exit_description(process)}")
        if not dead:
            return ProcessDiedError("a child process of the reading service closed its channel unexpectedly")
        return ProcessDiedError(
            "; ".join(dead) + ". The reading service cannot continue: look for an out-of-memory kill, a call "
            "to os._exit or a crash in native code in that process (its stderr may say more), then create "
            "a new DataLoader2."
        )

    def _check_open(self) -> ServiceResources:
        if self._res.stopped:
            raise ServiceClosedError(
                "this reading service has been shut down (DataLoader2.shutdown() or an earlier error); "
                "create a new DataLoader2 to iterate again"
            )
        return self._res

    # -- stop ----------------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self._res.stopped

    def processes(self) -> list[Any]:
        return self._res.processes()

    def stop(self) -> None:
        self._finalizer()
