"""Seen where people already look: torch.profiler's ranges under torch's names, a timeline of
every process in Chrome's trace-event format, and the figures for a logger.

The profiler's names are checked by the rule the tools that read them apply (TensorBoard's
profiler plugin and Holistic Trace Analysis count a step's data loading by the ranges whose
name starts with ``enumerate(DataLoader)``), in a trace torch itself exported. A timeline is
checked against the trace-event format's rules (complete events that nest per track,
metadata naming each process) and for what it must show; every death is forced."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch
from torch.profiler import profile
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import mprs_plus
from restart_datasets import Draws

DATALOADER_RULE = "enumerate(DataLoader)"  # what the TensorBoard plugin and HTA look for


class Slow(Dataset):
    """Samples that take ``seconds`` each (a decode, say); worker ``slow_worker``'s take
    ``factor`` times as long."""

    def __init__(self, n: int = 48, seconds: float = 0.002, slow_worker: int = -1, factor: int = 1) -> None:
        self.n, self.seconds, self.slow_worker, self.factor = n, seconds, slow_worker, factor

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        info = torch.utils.data.get_worker_info()
        slow = info is not None and info.id == self.slow_worker
        time.sleep(self.seconds * (self.factor if slow else 1))
        return i


def _nap(worker_id: int) -> None:
    time.sleep(0.03)


def _exported(tmp_path, loader, step=None) -> list[dict]:
    """The events torch.profiler exported for one epoch of ``loader``."""
    with profile() as prof:
        for batch in loader:
            if step is not None:
                step(batch)
    path = tmp_path / "torch_trace.json"
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())["traceEvents"]


def _loading_ranges(events: list[dict]) -> list[str]:
    return [e["name"] for e in events if e.get("ph") == "X" and e.get("name", "").startswith(DATALOADER_RULE)]


# -- torch.profiler ------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_profiler_sees_the_loaders_next_as_torchs_data_loading(tmp_path, num_workers):
    data = list(range(24))
    theirs = _loading_ranges(_exported(tmp_path, TorchDataLoader(data, batch_size=4, num_workers=num_workers)))
    ours = _loading_ranges(_exported(tmp_path, mprs_plus.DataLoader(data, batch_size=4, num_workers=num_workers)))
    # One range per next(), the last (StopIteration) included, as torch's loader records.
    assert len(ours) == len(theirs) == 7
    assert set(ours) == {"enumerate(DataLoader)#LoaderIterator.__next__"}
    assert all(name.endswith(".__next__") and "#_" in name for name in theirs)  # torch's iterator classes


def test_dataloader2_with_the_service_shows_its_reads_as_with_torchdatas(tmp_path):
    from torchdata.dataloader2 import DataLoader2, MultiProcessingReadingService
    from torchdata.datapipes.iter import IterableWrapper

    def ranges(reading_service):
        loader = DataLoader2(IterableWrapper(range(20)).sharding_filter().batch(4), reading_service=reading_service)
        try:
            events = _exported(tmp_path, loader)
        finally:
            loader.shutdown()
        return Counter(e["name"] for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation")

    theirs = ranges(MultiProcessingReadingService(num_workers=1))
    ours = ranges(mprs_plus.MultiProcessingReadingService(num_workers=1))
    # Each next() a range named for the main process's reader, as torch names a DataPipe.
    assert sum(theirs.values()) == sum(ours.values()) == 6
    assert list(ours) == ["WorkerReader()"]


def test_without_a_profiler_nothing_is_recorded(monkeypatch):
    import mprs_plus.dataloader.iterator as iterator

    entered = []
    monkeypatch.setattr(iterator, "record_function", lambda name: entered.append(name))
    assert len(list(mprs_plus.DataLoader(list(range(8)), batch_size=2))) == 4
    assert entered == []  # never asked for a range: no profiler was active


# -- the timeline: the trace-event format's rules ------------------------------------------


def check_trace_events(trace: dict) -> dict[tuple, list[dict]]:
    """Fail unless ``trace`` is a valid trace-event JSON object as Perfetto and Chrome read it:
    every event has ``ph``, ``pid``, ``tid`` (and ``ts`` unless metadata); complete events have
    a ``dur`` >= 0; on each track (pid, tid), complete events nest or follow each other, and
    their starts never go back in file order. Returns the events of each track."""
    json.loads(json.dumps(trace))  # plain JSON
    assert isinstance(trace["traceEvents"], list)
    tracks: dict[tuple, list[dict]] = {}
    for event in trace["traceEvents"]:
        assert event["ph"] in ("X", "i", "M"), event
        assert isinstance(event["name"], str) and event["name"]
        assert "pid" in event and "tid" in event, event
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "process_sort_index", "thread_name"), event
            continue
        assert isinstance(event["ts"], (int, float)), event
        if event["ph"] == "X":
            assert event["dur"] >= 0, event
        else:
            assert event["s"] in ("t", "p", "g"), event
        tracks.setdefault((event["pid"], event["tid"]), []).append(event)
    for track, events in tracks.items():
        starts = [e["ts"] for e in events]
        assert starts == sorted(starts), f"track {track}: starts go back"
        open_ends: list[float] = []
        for e in events:
            if e["ph"] != "X":
                continue
            while open_ends and open_ends[-1] <= e["ts"] + 1e-3:  # ns rounding of ts + dur
                open_ends.pop()
            end = e["ts"] + e["dur"]
            assert not open_ends or end <= open_ends[-1] + 1e-3, f"track {track}: {e} overlaps its parent"
            open_ends.append(end)
    return tracks


def _process_names(trace: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}


def _names_on(tracks: dict, pid: int) -> Counter:
    return Counter(e["name"] for (p, _), events in tracks.items() if p == pid for e in events)


def test_a_timeline_has_a_track_per_process_whose_spans_nest_on_one_clock(tmp_path):
    loader = mprs_plus.DataLoader(
        Slow(48, 0.002, slow_worker=1, factor=3), batch_size=4, num_workers=2, worker_init_fn=_nap, timeline=True
    )
    for _ in loader:
        time.sleep(0.001)  # the step
    stats = loader.stats()
    trace = stats.timeline()
    tracks = check_trace_events(trace)
    names = _process_names(trace)
    assert sorted(n.split(" (pid")[0] for n in names.values()) == ["main", "worker 0", "worker 1"]
    pid_of = {n.split(" (pid")[0]: pid for pid, n in names.items()}
    assert {pid for pid, _ in tracks} == set(pid_of.values())  # each process has a track, and only they
    main = _names_on(tracks, pid_of["main"])
    assert main["next(): waiting for a batch"] >= 1 and main["your step"] >= 1 and main["starting"] == 1
    assert main["epoch 1 begins"] == 1 and main["epoch ends"] == 1
    for worker in ("worker 0", "worker 1"):
        seen = _names_on(tracks, pid_of[worker])
        assert seen["busy"] >= 1 and seen["epoch 1 set-up"] == 1  # worker_init_fn's 30 ms in it
    # Busy covers each worker's work: at least the time its 24 samples slept (6 ms each on
    # worker 1, 2 ms on worker 0), however loaded the machine.
    busy = {
        w: sum(e["dur"] for e in tracks[(pid_of[w], 0)] if e["name"] == "busy") for w in ("worker 0", "worker 1")
    }
    assert busy["worker 0"] >= 24 * 2000 and busy["worker 1"] >= 24 * 6000
    # One clock: a batch is made before the loop receives it. Worker 0 makes the first batch;
    # its first busy span begins before the loop's first next() ends.
    first_next = min(
        e["ts"] + e["dur"] for e in tracks[(pid_of["main"], 0)] if e["name"] == "next(): waiting for a batch"
    )
    assert min(e["ts"] for e in tracks[(pid_of["worker 0"], 0)] if e["name"] == "busy") < first_next
    path = stats.write_timeline(tmp_path / "trace.json")
    assert json.loads(open(path).read())["traceEvents"]
    import copy
    import pickle

    assert pickle.loads(pickle.dumps(stats)).timeline() == copy.deepcopy(stats).timeline() == stats.timeline()


def test_a_killed_worker_shows_its_death_and_its_replacements_own_track(tmp_path):
    loader = mprs_plus.DataLoader(
        Draws(kill_at=29, marker=str(tmp_path / "killed")),
        batch_size=4,
        num_workers=2,
        worker_restarts=1,
        timeline=True,
    )
    with pytest.warns(RuntimeWarning, match="A new worker replaces it"):
        assert len(list(loader)) == 12
    stats = loader.stats()
    (made,) = stats.replacements
    trace = stats.timeline()
    tracks = check_trace_events(trace)
    names = _process_names(trace)
    assert names[made.pid] == f"worker 1 (pid {made.pid})"
    (second,) = [pid for pid, name in names.items() if name.startswith("worker 1, life 2")]
    assert second != made.pid
    dead = _names_on(tracks, made.pid)
    assert dead["died (SIGKILL)"] == 1 and dead["started"] == 1
    assert _names_on(tracks, second)["started"] == 1
    service = [e for e in tracks[(next(p for p, n in names.items() if n.startswith("main")), 1)]]
    assert [e["name"] for e in service if e["name"].startswith("replacing")] == ["replacing worker 1"]
    # The replacement's life begins after the death was found.
    death = next(e["ts"] for e in tracks[(made.pid, 0)] if e["name"].startswith("died"))
    assert min(e["ts"] for e in tracks[(second, 0)]) >= death


def test_a_timeline_keeps_the_last_records_of_each_process_and_no_more():
    loader = mprs_plus.DataLoader(Slow(96, 0.0005), batch_size=2, num_workers=2, persistent_workers=True, timeline=16)
    for _ in range(2):
        for _ in loader:
            time.sleep(0.0002)
    trace = loader.stats().timeline()
    tracks = check_trace_events(trace)
    assert max(len(events) for events in tracks.values()) <= 17  # 16 kept (the loop's open run read as it stands)
    # The loop waits for every batch (the workers make one a millisecond, the step takes a
    # fifth of that): its ~200 spans wrapped its ring, which kept the last 16, all of epoch 2.
    main = next(pid for pid, name in _process_names(trace).items() if name.startswith("main"))
    loop = tracks[(main, 0)]
    assert 16 <= len(loop) <= 17 and loop[-1]["name"] == "epoch ends"
    (second,) = [e["ts"] for e in tracks[(main, 1)] if e["name"] == "epoch 2 begins"]
    assert loop[0]["ts"] > second


def test_without_timeline_nothing_is_recorded():
    loader = mprs_plus.DataLoader(list(range(8)), batch_size=2, num_workers=1)
    assert len(list(loader)) == 4
    stats = loader.stats()
    assert stats.trace is None
    with pytest.raises(ValueError, match="timeline=True"):
        stats.timeline()


def test_timeline_takes_true_false_or_a_count():
    from mprs_plus.options import Options

    assert Options(timeline=True).timeline_capacity == 32768
    assert Options(timeline=64).timeline_capacity == 64
    assert Options().timeline_capacity == 0
    with pytest.raises(ValueError, match="timeline must be"):
        Options(timeline=3)
    with pytest.raises(ValueError, match="collect_stats=True"):
        Options(timeline=True, collect_stats=False)


# -- the page, the merge, the loggers ------------------------------------------------------


def _small_trace(tmp_path):
    loader = mprs_plus.DataLoader(Slow(16, 0.001), batch_size=2, num_workers=2, timeline=True)
    with profile() as prof:
        for _ in loader:
            time.sleep(0.002)
    prof.export_chrome_trace(str(tmp_path / "torch.json"))
    return loader.stats().timeline()


def test_the_page_is_self_contained_and_the_merge_lines_up_with_torchs_clock(tmp_path):
    from mprs_plus.__main__ import main
    from mprs_plus.timeline import merge_into

    timeline = _small_trace(tmp_path)
    (tmp_path / "trace.json").write_text(json.dumps(timeline))
    assert main(["timeline", str(tmp_path / "trace.json"), "-o", str(tmp_path / "page.html")]) == 0
    page = (tmp_path / "page.html").read_text()
    assert "<svg" in page and "worker 1 (pid" in page and "next(): waiting for a batch" in page
    assert "<script" not in page and "src=" not in page and "href=" not in page  # nothing fetched

    (tmp_path / "not_a_trace.json").write_text("{}")
    assert main(["timeline", str(tmp_path / "not_a_trace.json")]) == 2  # said on stderr, no page written
    assert not (tmp_path / "not_a_trace.html").exists()

    merged = json.loads(open(merge_into(tmp_path / "torch.json", timeline, tmp_path / "merged.json")).read())
    events = merged["traceEvents"]
    theirs = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith(DATALOADER_RULE)]
    ours = [e["ts"] for e in events if e.get("name") == "next(): waiting for a batch"]
    assert len(theirs) == 9 and ours  # a next() that found its batch waiting is under 20 us: not recorded
    # Each of our reads lies inside torch's range of the same next(), on torch's clock
    # (the loop's steps are 2 ms apart: a clock a few ms off would put them between ranges).
    for at in ours:
        assert any(start - 1000 <= at <= end + 1000 for start, end in theirs), at


def test_scalars_are_flat_floats_for_a_logger():
    loader = mprs_plus.DataLoader(list(range(16)), batch_size=2, num_workers=1)
    assert len(list(loader)) == 8
    scalars = loader.stats().scalars()
    assert set(scalars) == {
        "mprs_plus/items_per_s",
        "mprs_plus/loop_wait_share",
        "mprs_plus/workers_busy_share",
        "mprs_plus/workers_waiting_for_space_share",
        "mprs_plus/replacements",
        "mprs_plus/workers_private_mib",
        "mprs_plus/workers_copied_mib",
    }
    assert all(type(value) is float for value in scalars.values())
    assert scalars["mprs_plus/items_per_s"] > 0 and scalars["mprs_plus/replacements"] == 0.0


def test_the_lightning_callback_logs_the_loaders_figures(tmp_path):
    lightning = pytest.importorskip("lightning.pytorch")
    from mprs_plus.integrations.lightning import StatsLogger

    logged: list[dict] = []

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch.float().unsqueeze(1)).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def log_dict(self, values, *args, **kwargs):
            logged.append(dict(values))
            super().log_dict(values, *args, **kwargs)

    trainer = lightning.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[StatsLogger(every_n_steps=2)],
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Model(), mprs_plus.DataLoader(torch.arange(12), batch_size=2, num_workers=1))
    assert len(logged) == 3  # steps 2, 4, 6
    assert all("mprs_plus/loop_wait_share" in values for values in logged)


@pytest.mark.timeout(60)
def test_the_watchdogs_suspicion_is_on_the_timeline(monkeypatch):
    from torchdata.dataloader2 import DataLoader2

    import pipelines
    from mprs_plus.runtime.main import reader as main_reader

    monkeypatch.setattr(main_reader, "STUCK_SECONDS", 0.2)  # the detection span, small (as tests/test_stuck.py)
    service = mprs_plus.MultiProcessingReadingService(2, multiprocessing_context="fork", timeline=True)
    loader = DataLoader2(pipelines.starving_pipe(20000), reading_service=service)
    try:
        with pytest.raises(mprs_plus.PipelineStuckError):
            list(loader)
    finally:
        loader.shutdown()
    trace = service.stats().timeline()
    tracks = check_trace_events(trace)
    main = next(pid for pid, name in _process_names(trace).items() if name.startswith("main"))
    assert _names_on(tracks, main)["watchdog: worker 1 may be stuck"] == 1


def test_a_workers_ring_reaches_it_pickled_with_its_setup():
    # Under forkserver (as under spawn) a worker's setup is pickled, its rings with it; the
    # suite's forkserver is started once for every test that uses it.
    loader = mprs_plus.DataLoader(
        list(range(32)), batch_size=4, num_workers=2, multiprocessing_context="forkserver", timeline=True
    )
    assert len(list(loader)) == 8
    trace = loader.stats().timeline()
    tracks = check_trace_events(trace)
    names = _process_names(trace)
    assert sorted(name.split(" (pid")[0] for name in names.values()) == ["main", "worker 0", "worker 1"]
    for pid, name in names.items():
        if name.startswith("worker"):
            assert _names_on(tracks, pid)["started"] == 1
