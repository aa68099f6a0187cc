"""Fault injection: crashes, errors, interrupts, exits without shutdown.

Every case is bounded in time, interpreter-exit cases run in a subprocess, and the
autouse leak check (conftest) fails any test that leaves a child process or a
shared-memory segment behind.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import pipelines
from mprs_plus import MultiProcessingReadingService, ProcessDiedError, WorkerError
from mprs_plus.runtime.main.diagnose import find_unpicklable

TESTS = os.path.dirname(os.path.abspath(__file__))


def sharded(n: int, fn) -> object:
    return IterableWrapper(range(n)).sharding_filter().map(fn)


def dispatched(n: int, fn) -> object:
    pipe = IterableWrapper(range(n)).map(fn)
    return pipe.sharding_round_robin_dispatch(pipelines.SHARDING_PRIORITIES.MULTIPROCESSING).map(pipelines.pid_of)


def loader_for(pipe, **options):
    options.setdefault("num_workers", 2)
    return DataLoader2(pipe, reading_service=MultiProcessingReadingService(**options))


def children_of_this_test(before: set[int]) -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


# -- crashes -------------------------------------------------------------------------------


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_worker_killed_by_signal_is_reported_with_role_pid_and_signal(context):
    loader = loader_for(sharded(40, pipelines.kill_self_on), multiprocessing_context=context)
    with pytest.raises(ProcessDiedError, match=r"mprs_plus worker 1 \(pid \d+\) was killed by SIGKILL"):
        list(loader)
    loader.shutdown()


def test_worker_os_exit_is_reported_with_exit_code():
    loader = loader_for(sharded(40, pipelines.exit_on))
    with pytest.raises(ProcessDiedError, match=r"mprs_plus worker 1 \(pid \d+\) exited with code 3"):
        list(loader)
    loader.shutdown()


def test_dispatch_process_killed_is_reported():
    loader = loader_for(dispatched(40, pipelines.kill_self_on))
    with pytest.raises(ProcessDiedError, match=r"mprs_plus dispatch process \(pid \d+\) was killed by SIGKILL"):
        list(loader)
    loader.shutdown()


def test_worker_killed_from_outside_while_main_waits():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = loader_for(sharded(10, pipelines.block_on))
    iterator = iter(loader)
    next(iterator)
    stuck = children_of_this_test(before)
    assert len(stuck) == 2
    for worker in stuck:
        worker.send_signal(signal.SIGKILL)
    with pytest.raises(ProcessDiedError, match="killed by SIGKILL"):
        list(iterator)
    loader.shutdown()


def test_children_exit_when_the_main_process_is_killed(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, os
        sys.path.insert(0, {TESTS!r})
        import psutil, pipelines
        from torchdata.dataloader2 import DataLoader2
        from mprs_plus import MultiProcessingReadingService
        loader = DataLoader2(pipelines.NoGraphWrapper(1000), reading_service=MultiProcessingReadingService(2))
        it = iter(loader)
        next(it)
        print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
        sys.stdin.read()
        """
    )
    ours = _signal_state(os.getpid())
    main = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in main.stdout.readline().split()]
        assert len(pids) == 3
        children = [psutil.Process(pid) for pid in pids]
        main.kill()
        main.wait(10)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, "children outlived the killed main process"
    finally:
        main.kill()
        main.wait(10)


# -- errors with context -------------------------------------------------------------------


def test_main_segment_error_then_shutdown_is_clean():
    pipe = pipelines.NonReplicable(sharded(10, pipelines.pid_of)).map(pipelines.fail_on_5)
    loader = loader_for(pipe)
    with pytest.raises(ValueError, match="bad sample 5"):
        list(loader)
    loader.shutdown()


def test_exception_that_cannot_be_pickled_keeps_its_type_and_text():
    # Its lock cannot travel, but its class can: it is rebuilt from torch's message.
    loader = loader_for(sharded(10, pipelines.raise_unpicklable))
    with pytest.raises(pipelines.UnpicklableError) as info:
        list(loader)
    loader.shutdown()
    message = str(info.value)
    assert message.startswith("Caught UnpicklableError in worker process 0")
    assert "UnpicklableError: unpicklable failure at 2" in message
    assert "in raise_unpicklable" in message
    assert any("MapperIterDataPipe" in note for note in info.value.__notes__)


def test_exception_whose_constructor_wants_two_arguments_keeps_its_type():
    # Neither built from one message nor unpickled (its constructor wants two arguments):
    # made without its constructor, its args set back; the torch text is its first note.
    loader = loader_for(sharded(10, pipelines.raise_needs_two))
    with pytest.raises(pipelines.NeedsTwoArgsError) as info:
        list(loader)
    loader.shutdown()
    assert str(info.value).startswith("odd failure at 2")  # and torch's DataPipe note, as with num_workers=0
    assert info.value.__notes__[0].startswith("Caught NeedsTwoArgsError in worker process 0")
    assert "NeedsTwoArgsError: odd failure at 2" in info.value.__notes__[0]


def test_error_in_worker_init_fn_surfaces():
    loader = loader_for(sharded(6, pipelines.pid_of), worker_init_fn=pipelines.broken_init_fn)
    with pytest.raises(RuntimeError, match="init failed in worker"):
        list(loader)
    loader.shutdown()


# -- interrupts and timeouts ---------------------------------------------------------------


def test_timeout_raises_a_clear_error(short_stop_grace):
    loader = loader_for(sharded(10, pipelines.block_on), timeout=1.0)
    with pytest.raises(TimeoutError, match=r"no item from worker 1 within timeout=1.0 s"):
        list(loader)
    loader.shutdown()


def _run_script(body: str, timeout: float = 60, **popen) -> subprocess.CompletedProcess:
    script = f"import sys\nsys.path.insert(0, {TESTS!r})\n" + body
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=timeout, **popen
    )


@pytest.fixture
def sigint_as_in_a_terminal():
    """SIGINT handled as Python handles it in a terminal, whatever this run inherited: a
    background job of a shell without job control starts with SIGINT ignored, and an
    ignored SIGINT is kept by Python and passed on to every process it starts (so a
    Ctrl-C test would wait for an interrupt that can never come). A handled signal is
    reset to its default by an exec, and a fork keeps the handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_stops_cleanly_without_child_tracebacks(tmp_path, sigint_as_in_a_terminal, short_stop_grace):
    script = textwrap.dedent(
        f"""
        import faulthandler, sys
        faulthandler.enable(all_threads=True)  # on SIGABRT, this process and its forks write their stacks
        sys.path.insert(0, {TESTS!r})
        import psutil, pipelines
        from torchdata.dataloader2 import DataLoader2
        from torchdata.datapipes.iter import IterableWrapper
        from mprs_plus import MultiProcessingReadingService
        from mprs_plus.runtime.main import lifecycle
        lifecycle.STOP_GRACE = {short_stop_grace!r}  # a blocked worker: the stop is tested, not its grace
        pipe = IterableWrapper(range(10)).sharding_filter().map(pipelines.block_on)
        loader = DataLoader2(pipe, reading_service=MultiProcessingReadingService(2))
        try:
            it = iter(loader)
            next(it)
            print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
            list(it)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        """
    )
    ours = _signal_state(os.getpid())
    main = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, like a terminal job
    )
    try:
        children = [psutil.Process(int(pid)) for pid in main.stdout.readline().split()]
        assert len(children) == 2
        os.killpg(main.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        try:
            out, err = main.communicate(timeout=60)  # a hang's bound: seconds here, more on a loaded machine
        except subprocess.TimeoutExpired:
            theirs = _signal_state(main.pid)
            os.killpg(main.pid, signal.SIGABRT)  # every process of the group writes its stacks and dies
            out, err = main.communicate(timeout=30)
            pytest.fail(f"no stop 60 s after Ctrl-C; signals here {ours}, there {theirs}; the stacks:\n{err}")
    finally:
        if main.poll() is None:
            os.killpg(main.pid, signal.SIGKILL)
            main.wait(10)
    assert "interrupted" in out
    assert main.returncode == 0
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive


_SIGNAL_FIELDS = ("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")


def _signal_state(pid: int) -> dict[str, str]:
    """What the kernel holds of a process's signals, thread by thread (masks in hex)."""
    state = {}
    for task in sorted(os.listdir(f"/proc/{pid}/task")):
        with open(f"/proc/{pid}/task/{task}/status") as status:
            state[task] = " ".join(line.strip() for line in status if line.startswith(_SIGNAL_FIELDS))
    return state


class _SigmaskInterruptedOnce:
    """The signal module as Python runs it with a Ctrl-C pending: ``pthread_sigmask``
    changes the mask, then raises KeyboardInterrupt (once, at the call ``how`` names)."""

    def __init__(self, how: int) -> None:
        self.SIGINT, self.SIG_BLOCK, self.SIG_SETMASK = signal.SIGINT, signal.SIG_BLOCK, signal.SIG_SETMASK
        self._how, self.raised = how, False

    def pthread_sigmask(self, how, mask):
        previous = signal.pthread_sigmask(how, mask)
        query = how == signal.SIG_BLOCK and not set(mask)  # reads the mask, changes nothing
        if how == self._how and not query and not self.raised:
            self.raised = True
            raise KeyboardInterrupt
        return previous


def _wait_forever(setup) -> None:
    threading.Event().wait()


@pytest.mark.parametrize("at", ["block", "restore"])
def test_a_ctrl_c_pending_as_a_child_starts_leaves_sigint_unblocked_and_no_child_running(monkeypatch, at):
    """A Ctrl-C that comes as a child starts is raised by Python inside ``pthread_sigmask``
    after the mask changed: at the block, SIGINT must not stay blocked (every later Ctrl-C
    would pend unseen: a loader that Ctrl-C cannot stop); at the restore, the child just
    started must not run on, unknown to the service's stop."""
    from mprs_plus.backends import local

    fake = _SigmaskInterruptedOnce(signal.SIG_BLOCK if at == "block" else signal.SIG_SETMASK)
    monkeypatch.setattr(local, "signal", fake)
    before = set(psutil.Process().children())
    try:
        with pytest.raises(KeyboardInterrupt):
            local.LocalPlacement(multiprocessing.get_context("fork")).start("worker 0", _wait_forever, None)
        assert fake.raised
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, ())
        assert set(psutil.Process().children()) <= before
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.parametrize("dispatch", [False, True], ids=["worker", "dispatch"])
def test_a_ctrl_c_that_reaches_a_child_before_its_setup_is_dropped(
    monkeypatch, capfd, dispatch, sigint_as_in_a_terminal
):
    """Ctrl-C reaches every process of the group, also a child that is forked but has not
    begun to ignore SIGINT yet (on a loaded machine it may wait long for the CPU). Forced:
    each child gets a SIGINT just before its setup runs. It must hold it until it ignores
    it, and run on."""
    from mprs_plus.runtime.child import dispatch as dispatch_child
    from mprs_plus.runtime.child import worker as worker_child

    for module in (worker_child, dispatch_child):
        real_setup = module.child_setup

        def interrupted_first(endpoints, real_setup=real_setup):
            os.kill(os.getpid(), signal.SIGINT)  # the window: SIGINT before the setup ignores it
            real_setup(endpoints)

        monkeypatch.setattr(module, "child_setup", interrupted_first)
    pipe = IterableWrapper(range(12))
    if dispatch:
        pipe = pipe.sharding_round_robin_dispatch(pipelines.SHARDING_PRIORITIES.MULTIPROCESSING)
    else:
        pipe = pipe.sharding_filter()
    loader = loader_for(pipe.map(pipelines.identity), multiprocessing_context="fork")  # a fork carries the patch
    try:
        assert sorted(loader) == list(range(12))
    finally:
        loader.shutdown()
    assert "KeyboardInterrupt" not in capfd.readouterr().err


# -- exits without shutdown ----------------------------------------------------------------

EXIT_CASES = {
    "loader_in_a_global": """
        loader = DataLoader2(pipelines.NoGraphWrapper(100), reading_service=MultiProcessingReadingService(2))
        list(loader)
    """,
    "iterator_kept_mid_epoch": """
        loader = DataLoader2(pipelines.NoGraphWrapper(100000), reading_service=MultiProcessingReadingService(2))
        it = iter(loader)
        next(it)
    """,
    "iterators_kept_after_shutdown": """
        import mprs_plus
        for _ in range(2):
            loader = DataLoader2(pipelines.sharded_pipe(100000), reading_service=mprs_plus.MultiProcessingReadingService(2))
            it = iter(loader)
            next(it)
            print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
            loader.shutdown()  # the iterator outlives the service, until interpreter exit
    """,
    "loop_broken_early": """
        loader = DataLoader2(pipelines.sharded_pipe(100000), reading_service=MultiProcessingReadingService(2))
        for i, x in enumerate(loader):
            if i == 10:
                break
    """,
    "spawn_iterator_kept": """
        loader = DataLoader2(pipelines.NoGraphWrapper(100000),
                             reading_service=MultiProcessingReadingService(2, multiprocessing_context="spawn"))
        it = iter(loader)
        next(it)
    """,
}


@pytest.mark.parametrize("case", sorted(EXIT_CASES))
def test_interpreter_exits_promptly_and_leaves_no_process(case):
    body = "\n".join(
        [
            "import psutil, pipelines",
            "from torchdata.dataloader2 import DataLoader2",
            "from mprs_plus import MultiProcessingReadingService",
            textwrap.dedent(EXIT_CASES[case]),
            'print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)',
        ]
    )
    done = _run_script(body, timeout=60)
    assert done.returncode == 0, done.stderr
    pids = [int(p) for p in done.stdout.split()]
    assert pids, "the service should have started processes"
    survivors = []
    for pid in pids:
        try:
            survivors.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    # multiprocessing's resource tracker (spawn) exits on its own once its parent is gone.
    _, alive = psutil.wait_procs(survivors, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert "Traceback" not in done.stderr, done.stderr


def test_garbage_collection_stops_the_service():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = loader_for(pipelines.NoGraphWrapper(1000))
    it = iter(loader)
    next(it)
    started = children_of_this_test(before)
    assert len(started) == 3
    del it, loader
    gc.collect()
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive


def test_recreating_loaders_every_epoch_does_not_accumulate_processes():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    for _ in range(6):
        loader = loader_for(pipelines.sharded_pipe(20))
        assert len(list(loader)) == 20
        alive = [p for p in children_of_this_test(before) if p.status() != psutil.STATUS_ZOMBIE]
        assert len(alive) <= 2 + 2  # this loader's workers, plus at most the previous ones exiting
    del loader


# -- bad input, up front -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"num_workers": -1}, ValueError, "num_workers must be >= 0"),
        ({"num_workers": 1.5}, TypeError, "num_workers must be an int"),
        ({"num_workers": 2, "multiprocessing_context": "thread"}, ValueError, "not a start method"),
        ({"num_workers": 2, "worker_prefetch_cnt": -1}, ValueError, "worker_prefetch_cnt must be >= 0"),
        ({"num_workers": 2, "main_prefetch_cnt": -3}, ValueError, "main_prefetch_cnt must be >= 0"),
        ({"num_workers": 2, "worker_init_fn": 42}, TypeError, "worker_init_fn must be callable"),
        ({"num_workers": 2, "worker_reset_fn": "reset"}, TypeError, "worker_reset_fn must be callable"),
        ({"num_workers": 2, "timeout": 0}, ValueError, "timeout must be"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiProcessingReadingService(**kwargs)


def test_unpicklable_segment_under_spawn_names_the_object(monkeypatch):
    from mprs_plus.options import Options
    from mprs_plus.plan import plan
    from mprs_plus.runtime import segments
    from mprs_plus.runtime.main.service import ServiceRuntime

    monkeypatch.setattr(segments, "_dill", lambda: None)  # as when dill is not installed

    local = lambda x: x  # noqa: E731 - the point of the test
    runtime = ServiceRuntime(plan(sharded(4, local), 2), Options(num_workers=2, multiprocessing_context="spawn"))
    with pytest.raises(TypeError, match=r"MapperIterDataPipe\.fn = <function .* cannot be pickled .*lambda") as info:
        runtime.start()
    assert "module-level function" in str(info.value)
    assert "install dill" in str(info.value)
    runtime.stop()


def test_find_unpicklable_walks_into_nograph_and_containers(tmp_path, monkeypatch):
    from mprs_plus.runtime import segments

    monkeypatch.setattr(segments, "_dill", lambda: None)  # dill would carry the open file
    with open(tmp_path / "f.txt", "w") as handle:
        holder = pipelines.Outer(IterableWrapper([1]))
        holder.files = {"log": [handle]}
        path, value, _ = find_unpicklable(holder, "pipe")
    assert path == "Outer.files['log'][0]"


def test_iterating_after_shutdown_is_a_clear_error():
    loader = loader_for(pipelines.sharded_pipe(4))
    list(loader)
    loader.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        next(iter(loader))
