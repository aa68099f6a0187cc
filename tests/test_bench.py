"""The benchmark suite runs end to end and reports every workload and contender.

Nothing here asserts anything about speed: ``--quick`` is a smoke test of the suite's
machinery (interleaving, failure recording, JSON, plot), run in a subprocess with a
timeout so that a hang fails the test instead of the session.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mprs_plus._cli import bench

ROOT = Path(__file__).resolve().parent.parent

QUICK_WORKLOADS = {
    "tiny_items",
    "numpy_arrays",
    "torch_tensors",
    "large_tensors",
    "cpu_bound",
    "dispatch_pipeline",
    "seed_wrapper",
    "startup_shutdown",
}
CONTENDERS = {"mprs_plus", "torchdata", "torch", "in-process", "spdl"}
# Where SPDL's iterate_in_subprocess runs the same items as the others (one subprocess).
SPDL_WORKLOADS = {"tiny_items", "numpy_arrays", "torch_tensors", "large_tensors", "cpu_bound"}
STATUSES = {"ok", "failed", "n/a"}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _run_script(script: str, *options: str, timeout: float = 105) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script> <options>`` in a subprocess, bounded in time; it must succeed."""
    done = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *options],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _run_quick_suite(out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return _run_script("run.py", "--quick", "--no-progress", *options, "--out", str(out))


def test_quick_run_reports_every_workload_and_contender(tmp_path: Path) -> None:
    done = _run_quick_suite(tmp_path)
    [result_file] = tmp_path.glob("*.json")
    result = json.loads(result_file.read_text())

    assert set(result["workloads"]) == QUICK_WORKLOADS
    for name, workload in result["workloads"].items():
        assert set(workload["contenders"]) == CONTENDERS, name
        for contender, cell in workload["contenders"].items():
            assert cell["status"] in STATUSES, (name, contender)
            if cell["status"] == "failed":
                assert cell["errors"], (name, contender)  # a failure always says why
            if cell["status"] == "ok":
                assert all(cell["samples"][m["key"]] for m in workload["metrics"]), (name, contender)
        assert workload["contenders"]["mprs_plus"]["status"] != "n/a", name
    environment = result["environment"]
    for key in ("python", "versions", "cpu_model", "logical_cores", "start_method", "date", "git"):
        assert key in environment, key
    assert environment["start_method"] == "fork"
    assert result["memcpy"]["median_gbps"] > 0
    assert list(tmp_path.glob("*.png")), "no plot written"
    assert "PASS" in done.stdout or "MISS" in done.stdout  # the table has its verdict column
    for name, workload in result["workloads"].items():
        spdl = workload["contenders"]["spdl"]
        assert spdl["note"], name  # it runs one subprocess, or why it does not apply
        if name in SPDL_WORKLOADS:
            assert spdl["status"] == "ok", (name, spdl["errors"])
            assert "ONE subprocess" in spdl["note"], name
        else:
            assert spdl["status"] == "n/a", name
    assert result["environment"]["versions"]["spdl"]
    spdl_target = [t for t in result["workloads"]["numpy_arrays"]["targets"] if t["against"] == "spdl"]
    assert spdl_target and spdl_target[0]["threshold"] == 1.0 and spdl_target[0]["value"] > 0
    for name in ("numpy_arrays", "torch_tensors", "large_tensors"):
        # Main-process CPU per byte is reported for every contender that ran.
        for contender, cell in result["workloads"][name]["contenders"].items():
            if cell["status"] == "ok":
                assert cell["samples"]["main_cpu_gbps"][0] > 0, (name, contender)


def test_main_cpu_floor_script_reports_every_case() -> None:
    """``benchmarks/main_cpu_floor.py --quick`` runs end to end (no figure is checked; one
    run per case is enough for that)."""
    done = _run_script("main_cpu_floor.py", "--quick", "--runs", "1")
    assert "the target per 4 MiB item" in done.stdout
    rows = [line for line in done.stdout.splitlines() if "us per item" in line]
    assert len(rows) == 10, done.stdout
    for case in ("DataLoader2 + mprs_plus, 1 ms step", "DataLoader2 in-process, 1 ms step"):
        assert any(row.startswith(case) for row in rows), done.stdout


def test_workers_sweep_runs_the_suite_once_per_count(tmp_path: Path) -> None:
    done = _run_quick_suite(tmp_path, "--only", "tiny_items", "--contenders", "mprs_plus,in-process", "--workers", "1,2")
    per_count = sorted(json.loads(p.read_text())["settings"]["num_workers"] for p in tmp_path.glob("bench-*.json"))
    assert per_count == [1, 2]
    [sweep_file] = tmp_path.glob("sweep-*.json")
    sweep = json.loads(sweep_file.read_text())
    assert sweep["workers"] == [1, 2]
    [series] = [s for s in sweep["series"] if s["workload"] == "tiny_items"]
    assert all(v > 0 for v in series["medians"]["mprs_plus"])
    assert len(series["medians"]["mprs_plus"]) == 2
    assert list(tmp_path.glob("sweep-*.png")), "no sweep plot written"
    assert "workers sweep" in done.stdout


@pytest.mark.parametrize("value", ["0", "two", "1,,0", ""])
def test_workers_option_rejects_what_is_not_a_count(value: str, capsys) -> None:
    from benchmarks import run

    with pytest.raises(SystemExit) as exit_info:
        run.build_parser().parse_args(["--workers", value])
    assert exit_info.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_bench_command_forwards_help_to_the_suite() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mprs_plus", "bench", "--help"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--quick" in done.stdout and "--context" in done.stdout


def test_bench_command_finds_the_suite_only_in_a_source_checkout(tmp_path: Path) -> None:
    assert bench.suite_path() == ROOT / "benchmarks" / "run.py"
    installed_alone = tmp_path / "site-packages" / "mprs_plus"
    installed_alone.mkdir(parents=True)
    assert bench.suite_path(installed_alone) is None


def test_bench_command_explains_what_to_do_without_a_checkout(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench, "suite_path", lambda: None)
    assert bench.run(bench.argparse.Namespace(rest=["--quick"])) == 2
    assert "source repository" in capsys.readouterr().err


# -- the SPDL contender ----------------------------------------------------------------------


def _shm_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/dev/shm", name))


@pytest.mark.parametrize("stop_early", [False, True], ids=["whole-epoch", "stopped-early"])
def test_spdl_contender_ends_its_subprocess_and_removes_its_pool(stop_early: bool) -> None:
    pytest.importorskip("spdl.pipeline")
    from benchmarks import harness
    from benchmarks.workloads._shared import ShardedRange, numpy_array, spdl_pool

    settings = harness.Settings(quick=True, context="fork", shutdown_limit_s=15.0)
    n = 40
    fn = functools.partial(numpy_array, nbytes=harness.MiB)
    with harness.deadline(60, "the SPDL loader"):
        loader = harness.open_loader(harness.SPDL, settings, dataset=ShardedRange(n, fn), pool=spdl_pool(harness.MiB))
        try:
            names = loader.segment_names
            assert len(names) == 1 + spdl_pool(harness.MiB).count  # a control segment, then one per item
            assert all(_shm_exists(name) for name in names)
            children = harness.child_processes()
            assert children, "SPDL runs its iterable in a subprocess"
            values = []
            for item in loader:
                values.append(int(item[0]))  # the items are the workload's, in order
                if stop_early and len(values) == n // 4:
                    break
            item = None  # a held item pins its segment, as any consumer's would
        finally:
            problem = harness.close_within(loader, settings)
    assert problem is None
    assert values == [i % 251 for i in range(len(values))] and len(values) == (n // 4 if stop_early else n)
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"SPDL's subprocess outlived close(): {alive}"
    assert not [name for name in names if _shm_exists(name)], "SPDL's pool left segments in /dev/shm"


def test_suite_records_spdl_as_not_applicable_when_it_is_not_installed(monkeypatch) -> None:
    from benchmarks import harness
    from benchmarks.workloads._shared import identity, mapped_range_runners

    monkeypatch.setitem(sys.modules, "spdl", None)  # "import spdl" now raises ImportError
    monkeypatch.delitem(sys.modules, "spdl.pipeline", raising=False)
    workload = harness.Workload(
        name="few_ints",
        title="few ints",
        description="ints through an identity map",
        metrics=(harness.Metric("throughput", "items/s"),),
        runners=mapped_range_runners(items=lambda s: 200, make_fn=lambda s: identity),
    )
    settings = harness.Settings(quick=True, repetitions=1, budget_s=0.05)
    results = harness.run_suite([workload], settings, (harness.IN_PROCESS, harness.SPDL), progress=False)
    cells = results.cells["few_ints"]
    assert cells[harness.IN_PROCESS].status == harness.OK
    assert cells[harness.SPDL].status == harness.NOT_APPLICABLE
    assert "not installed" in cells[harness.SPDL].note and "bench" in cells[harness.SPDL].note
    assert not cells[harness.SPDL].errors


def test_spdl_pool_under_another_start_method_fails_clearly_and_leaves_nothing(monkeypatch) -> None:
    # SPDL's pool makes its condition variable in multiprocessing's default context (fork
    # here), so a spawn subprocess cannot share it: the suite records why, and cleans up.
    pytest.importorskip("spdl.pipeline")
    from benchmarks import _spdl, harness
    from benchmarks.workloads._shared import ShardedRange, identity, spdl_pool

    if multiprocessing.get_start_method(allow_none=True) not in (None, "fork"):
        pytest.skip("the default start method is not fork")
    # The pool's own segments, by name: other processes on the machine (a second test
    # suite) make segments of the same prefix meanwhile.
    made: list[str] = []
    names_of = _spdl.segment_names

    def recorded(pool) -> list[str]:
        names = names_of(pool)
        made.extend(names)
        return names

    monkeypatch.setattr(_spdl, "segment_names", recorded)
    settings = harness.Settings(quick=True, context="spawn")
    with harness.deadline(60, "the SPDL loader"), pytest.raises(RuntimeError, match="default start method"):
        harness.open_loader(harness.SPDL, settings, dataset=ShardedRange(10, identity), pool=spdl_pool(harness.MiB))
    assert not harness.child_processes()
    assert made and not [name for name in made if _shm_exists(name)]


def test_spdl_segments_left_by_its_shutdown_are_reported_and_removed(monkeypatch) -> None:
    pytest.importorskip("spdl.pipeline")
    from benchmarks import _spdl, harness
    from benchmarks.workloads._shared import ShardedRange, numpy_array, spdl_pool

    monkeypatch.setattr(_spdl._QuietPool, "unlink", lambda self: None)  # a teardown that forgets
    settings = harness.Settings(quick=True, shutdown_limit_s=15.0)
    fn = functools.partial(numpy_array, nbytes=harness.MiB)
    with harness.deadline(60, "the SPDL loader"):
        loader = harness.open_loader(harness.SPDL, settings, dataset=ShardedRange(4, fn), pool=spdl_pool(harness.MiB))
        names = loader.segment_names
        assert sum(1 for _ in loader) == 4
        problem = harness.close_within(loader, settings)
    assert problem is not None and f"left {len(names)} segment(s)" in problem
    assert not [name for name in names if _shm_exists(name)]


def test_startup_profile_reports_phases_and_committed_memory() -> None:
    """``benchmarks/startup_profile.py`` times both contenders and splits mprs_plus's time
    into its phases; the phases add up to the time to the first item."""
    done = _run_script("startup_profile.py", "--workers", "2", "--trials", "1", timeout=60)
    lines = [line.split(" | ") for line in done.stdout.splitlines() if " | " in line]
    header, row = lines[0], dict(zip(lines[0], lines[1]))
    assert header[:3] == ["workers", "mprs_plus", "torch"]
    assert row["workers"] == "2"
    phases = ["construct", "plan", "copies", "channels", "processes", "messages", "first item"]
    assert abs(sum(float(row[p]) for p in phases) - float(row["mprs_plus"])) < 1.0  # ms: medians of one trial add up, but for rounding
    assert float(row["shared MiB/worker"]) >= 0


@pytest.mark.timeout(150)
def test_cold_start_runs_each_sample_in_a_fresh_process(tmp_path: Path) -> None:
    """The suite's cold start: one fresh interpreter per sample (after one that fills the
    bytecode caches), its cold and warm first items reported for both contenders."""
    _run_quick_suite(tmp_path, "--only", "cold_start", "--contenders", "mprs_plus,torch")
    [result_file] = tmp_path.glob("*.json")
    cells = json.loads(result_file.read_text())["workloads"]["cold_start"]["contenders"]
    for contender in ("mprs_plus", "torch"):
        cell = cells[contender]
        assert cell["status"] == "ok", (contender, cell["errors"])
        [detail] = cell["details"]
        [sample] = detail["samples"]
        assert 0 <= sample["imports"] < sample["cold_first_item"], contender
        assert cell["samples"]["warm_first_item"][0] > 0, contender


# -- the Ray comparison ----------------------------------------------------------------------

RAY_CONTENDERS = {"mprs_plus-ray", "mprs_plus-ray-near", "mprs_plus-ray-warm", "mprs_plus", "ray-data"}


@pytest.mark.timeout(300)
def test_ray_comparison_quick_run_reports_every_contender(tmp_path: Path) -> None:
    """``python -m benchmarks.ray_compare --quick`` runs end to end (no figure is checked).

    With Ray installed it starts and stops a two-node local cluster; without it, or while
    ``mprs_plus.RayBackend`` is not importable, those contenders are n/a, saying why. One
    workload (the arrays, which have every column) keeps it short: each Ray contender
    starts its processes anew per measurement, seconds each on an idle machine; on a
    loaded one the cluster's start and each Ray contender's first item took up to 30 s
    each (beside another test suite), hence the longer bound."""
    from benchmarks.workloads import ray_cluster

    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ray_compare", "--quick", "--only", "numpy_arrays", "--no-progress"]
        # The warm contender starts its actors twice (an untimed loader first): left out here.
        + ["--contenders", "mprs_plus-ray,mprs_plus-ray-near,mprs_plus,ray-data", "--out", str(tmp_path)],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=270,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result_file] = tmp_path.glob("ray-*.json")
    result = json.loads(result_file.read_text())
    assert set(result["workloads"]) == {"numpy_arrays"}
    expected = {
        "mprs_plus": None,
        "ray-data": ray_cluster.ray_missing() or "reference",
        "mprs_plus-ray": ray_cluster.ray_backend_missing(),
        "mprs_plus-ray-near": ray_cluster.ray_backend_missing(),
        "mprs_plus-ray-warm": "not selected in this run",
    }
    for name, workload in result["workloads"].items():
        assert set(workload["contenders"]) == RAY_CONTENDERS, name
        for contender, cell in workload["contenders"].items():
            if expected[contender] == "reference" and cell["status"] == "failed":
                # Ray Data is a reference, not ours: on a machine loaded by other work its
                # measurement may run past the harness's bound (90 s in a quick run), and
                # the report must say so. Ours must measure.
                assert cell["errors"] and cell["errors"][0].startswith("MeasurementTimeout"), cell["errors"]
            elif expected[contender] in (None, "reference"):
                assert cell["status"] == "ok", (name, contender, cell["errors"])
                keys = ("throughput", "epoch_throughput", "first_item")
                assert all(cell["samples"][key][0] > 0 for key in keys), (name, contender)
                assert cell["samples"]["main_cpu_per_item"][0] >= 0, (name, contender)
            else:
                assert cell["status"] == "n/a" and cell["note"] == expected[contender], (name, contender)
    arrays = [row for row in result["rows"] if row["workload"] == "numpy_arrays" and row["status"] == "ok"]
    assert arrays and all(row["gbps"] > 0 for row in arrays)
    assert not result["environment"].get("cluster_left_running"), "the cluster's processes outlived its shutdown"
    if expected["ray-data"] == "reference":
        assert "simulated nodes" in result["environment"]["cluster"]
    assert "| 1 MiB numpy arrays | mprs_plus |" in done.stdout  # the table


def test_ray_comparison_records_ray_as_not_applicable_when_it_is_not_installed(monkeypatch) -> None:
    from benchmarks import harness, ray_compare
    from benchmarks.workloads import ray_cluster

    monkeypatch.setitem(sys.modules, "ray", None)  # "import ray" now raises ImportError
    for name in [m for m in sys.modules if m.startswith("ray.")]:
        monkeypatch.delitem(sys.modules, name)
    backend_missing = ray_cluster.ray_backend_missing()
    missing = {
        "mprs_plus-ray": backend_missing,
        "mprs_plus-ray-near": backend_missing,
        "mprs_plus-ray-warm": backend_missing,
        "ray-data": ray_cluster.ray_missing(),
    }
    assert all("not installed" in why and "bench" in why for why in missing.values())
    settings = harness.Settings(quick=True, repetitions=1)
    tiny = ray_cluster.Case("few_ints", "few ints", "ints", items=lambda s: 2000, make_fn=lambda s: ray_cluster.identity)
    workloads = ray_cluster.workloads(None, (tiny,))
    results = ray_compare.run(workloads, settings, ray_cluster.CONTENDERS, missing, None, progress=False)
    cells = results.cells["few_ints"]
    assert cells["mprs_plus"].status == harness.OK
    assert cells["mprs_plus"].samples["first_item"][0] > 0
    for contender in ("mprs_plus-ray", "ray-data"):
        assert cells[contender].status == harness.NOT_APPLICABLE and not cells[contender].errors
        assert cells[contender].note == missing[contender]


# -- torch's loader API: mprs_plus.DataLoader beside its peers ---------------------------------

LOADER_WORKLOADS = {
    "ints",
    "rows",
    "tensors_1mib",
    "cpu_2ms",
    "jpeg",
    "state_every_batch",
    "ints_epoch",
    "tensors_1mib_epoch",
    "first_batch",
}


def _loader_compare_leaving_nothing(options: list[str], marker: str) -> subprocess.CompletedProcess:
    """``benchmarks/loader_compare.py`` with ``options``, every process of it marked in its
    environment; it must succeed, and none of them may outlive it (those that do are killed)."""
    done = subprocess.run(
        [sys.executable, "benchmarks/loader_compare.py", *options],
        cwd=ROOT,
        env={**_env(), "LOADER_COMPARE_RUN": marker},
        capture_output=True,
        text=True,
        timeout=120,
    )
    left = [p for p in psutil.process_iter() if _environment_of(p).get("LOADER_COMPARE_RUN") == marker]
    for process in left:
        process.kill()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not left, f"processes outlived the run: {[p.pid for p in left]}"
    return done


def _our_loader_missing() -> bool:
    from benchmarks.workloads import loaders

    return loaders.our_loader().cls is None


@pytest.mark.timeout(150)
def test_loader_comparison_quick_run_prints_its_table_and_leaves_no_process(tmp_path: Path) -> None:
    """``benchmarks/loader_compare.py --quick`` runs every workload and contender once and
    prints its table with a verdict per target (no figure is checked). While mprs_plus has no
    DataLoader, the stand-in plays its part. Every process of the run, its loaders' workers
    included, carries a marker in its environment: none may outlive the run."""
    options = ["--quick", "--no-progress", "--out", str(tmp_path)]
    if _our_loader_missing():
        options.append("--stand-in")
    done = _loader_compare_leaving_nothing(options, f"loader-compare-{os.getpid()}-{tmp_path.name}")

    assert "| workload | unit | mprs_plus | DataLoader | StatefulDataLoader | SPDL | reference | ratio | target | verdict |" in done.stdout
    [result_file] = tmp_path.glob("loaders-*.json")
    result = json.loads(result_file.read_text())
    assert set(result["workloads"]) == LOADER_WORKLOADS
    for name, workload in result["workloads"].items():
        for contender, cell in workload["contenders"].items():
            assert cell["status"] in STATUSES, (name, contender)
            assert not cell["killed_pids"], (name, contender)  # every loader ended its workers
            if cell["status"] == "failed":
                assert cell["errors"], (name, contender)
        assert workload["contenders"]["mprs_plus"]["status"] == "ok", (name, workload["contenders"]["mprs_plus"]["errors"])
    # mprs_plus's figures come from its worker processes, not from loading in the main process.
    [first] = result["workloads"]["first_batch"]["contenders"]["mprs_plus"]["details"]
    assert first["processes"] >= result["settings"]["num_workers"]
    # The CPU per sample of the main process and of each worker, beside the rate.
    [ints] = result["workloads"]["ints"]["contenders"]["mprs_plus"]["details"]
    assert len(ints["workers_cpu_per_sample"]) >= result["settings"]["num_workers"]
    assert ints["main_cpu_per_sample"] > 0 and all(cpu > 0 for cpu in ints["workers_cpu_per_sample"])
    assert "| workload | contender | rate | main | workers |" in done.stdout
    [epoch] = result["workloads"]["tensors_1mib_epoch"]["contenders"]["mprs_plus"]["details"]
    assert epoch["epoch_s"] > 0
    state = result["workloads"]["state_every_batch"]["contenders"]
    assert state["SPDL"]["status"] == "n/a" and "state_dict" in state["SPDL"]["note"]
    assert all(detail["states_taken"] > 0 for detail in state["mprs_plus"]["details"])
    targeted = [line for line in result["lines"] if line["threshold"] is not None]
    # One target per steady-state workload against the peers, three more against no
    # workers (ints, rows, 1 MiB tensors), two for the state; the whole epochs are shown only.
    assert len(targeted) == 11
    for line in targeted:
        assert line["verdict"] in ("PASS", "MISS"), line
        assert f"| {line['verdict']} |" in done.stdout
    assert result["environment"]["versions"]["pillow"]
    assert not os.path.exists(result["environment"]["jpeg_folder"]), "the generated JPEGs were left behind"


def _environment_of(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
        return {}


def test_loader_comparison_records_a_refusal_as_not_applicable_with_the_reason() -> None:
    """SPDL's loader refuses an iterable dataset: n/a with its reason, not a failure."""
    pytest.importorskip("spdl.dataloader")
    from benchmarks import harness
    from benchmarks.workloads import loaders
    from benchmarks.workloads._shared import ShardedRange, identity

    settings = harness.Settings(quick=True, budget_s=0.05)
    our = loaders.our_loader(stand_in=True)

    def runner(s: harness.Settings) -> dict[str, float]:
        open_ = lambda: loaders.open_loader(loaders.SPDL, our, s, ShardedRange(64, identity), batch_size=8)  # noqa: E731
        return loaders.throughput(open_, s, samples=64, batch_size=8)

    workload = harness.Workload(
        name="stream",
        title="an iterable dataset",
        description="ints from an IterableDataset",
        metrics=(loaders.SAMPLES,),
        runners={loaders.SPDL: runner},
    )
    cell = harness.Cell()
    harness._measure(workload, loaders.SPDL, settings, cell)
    assert cell.status == harness.NOT_APPLICABLE and not cell.errors
    assert "refuses" in cell.note and "IterableDataset is not supported" in cell.note


@pytest.mark.parametrize("stop_early", [False, True], ids=["whole-epoch", "stopped-early"])
def test_loader_comparison_spdl_loader_ends_its_workers_and_removes_its_dataset_copy(stop_early: bool) -> None:
    """SPDL copies the dataset into a shared-memory segment it never removes; the
    comparison's close() ends SPDL's workers and removes that segment."""
    pytest.importorskip("spdl.dataloader")
    from benchmarks import harness
    from benchmarks.workloads import loaders

    settings = harness.Settings(quick=True, shutdown_limit_s=15.0)
    our = loaders.our_loader(stand_in=True)
    with harness.deadline(60, "the SPDL loader"):
        loader = loaders.open_loader(loaders.SPDL, our, settings, loaders.Ints(640), batch_size=64)
        try:
            segment = loader.loader._shmem.name
            assert _shm_exists(segment)
            batches = []
            for batch in loader:
                batches.append(batch.tolist())
                if stop_early and len(batches) == 2:
                    break
                children = harness.child_processes()
            batch = None
        finally:
            problem = harness.close_within(loader, settings)
    assert problem is None
    # SPDL yields batches as they complete (its default in_order=False): whole batches, any order.
    assert all(b == list(range(b[0], b[0] + 64)) and b[0] % 64 == 0 for b in batches), batches
    assert len(batches) == (2 if stop_early else 10) and len({b[0] for b in batches}) == len(batches)
    assert children, "SPDL's workers are processes"
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"SPDL's workers outlived close(): {alive}"
    assert not _shm_exists(segment), "the dataset's copy was left in /dev/shm"


def test_loader_comparison_without_our_loader_reports_no_data_with_the_reason(monkeypatch) -> None:
    """While mprs_plus has no DataLoader, its column is n/a, saying why, and every target is
    without data; the peers still run."""
    import mprs_plus
    from benchmarks import harness, loader_compare
    from benchmarks.workloads import loaders

    # Neither the attribute nor its module: "from mprs_plus import DataLoader" now fails.
    monkeypatch.delattr(mprs_plus, "DataLoader", raising=False)
    monkeypatch.setitem(sys.modules, "mprs_plus.dataloader", None)
    our = loaders.our_loader()
    assert our.cls is None and "--stand-in" in our.missing
    selected = [(w, bars) for w, bars in loaders.workloads(our, []) if w.name == "first_batch"]
    settings = harness.Settings(quick=True, repetitions=1, shutdown_limit_s=15.0)
    results = loader_compare.run(selected, settings, our, progress=False)
    cells = results.cells["first_batch"]
    assert cells["mprs_plus"].status == harness.NOT_APPLICABLE and "not importable" in cells["mprs_plus"].note
    assert cells["DataLoader"].status == harness.OK, cells["DataLoader"].errors
    [line] = loader_compare.summarize(results, {w.name: bars for w, bars in selected})
    assert line.verdict.word == "NO DATA"
    assert "not importable" in loader_compare.table(results, [line])


def test_loader_comparison_takes_each_ratio_against_its_reference() -> None:
    """Pure: the best peer is the fastest that ran, a time's ratio is the reference's time
    over mprs_plus's, and each target's verdict follows its threshold."""
    from benchmarks import harness, loader_compare
    from benchmarks.workloads import loaders

    every = loaders.workloads(loaders.OurLoader(None), [])
    selected = [(w, bars) for w, bars in every if w.name in ("cpu_2ms", "first_batch")]
    workloads = [w for w, _ in selected]
    cells = {w.name: {c: harness.Cell() for c in loaders.CONTENDERS} for w in workloads}

    def measured(workload: str, contender: str, metric: str, *values: float) -> None:
        cells[workload][contender] = harness.Cell(status=harness.OK, samples={metric: list(values)})

    measured("cpu_2ms", "mprs_plus", "throughput", 900.0, 1000.0, 950.0)  # median 950
    measured("cpu_2ms", "DataLoader", "throughput", 800.0)
    measured("cpu_2ms", "StatefulDataLoader", "throughput", 1000.0)
    cells["cpu_2ms"]["SPDL"] = harness.Cell(status=harness.FAILED, errors=["RuntimeError: broke"])
    measured("first_batch", "mprs_plus", "first_batch", 0.020)
    measured("first_batch", "DataLoader", "first_batch", 0.030)
    results = harness.Results(harness.Settings(), {"cpu_model": "a CPU", "usable_cores": 2}, workloads, cells, [])

    cpu, first = loader_compare.summarize(results, {w.name: bars for w, bars in selected})
    assert cpu.reference == "StatefulDataLoader" and cpu.ratio == pytest.approx(0.95)
    assert cpu.verdict.word == "MISS"
    assert first.reference == "DataLoader" and first.ratio == pytest.approx(1.5)  # 30 ms over 20 ms
    assert first.verdict.word == "PASS"
    text = loader_compare.table(results, [cpu, first])
    assert "best: StatefulDataLoader 1k" in text and "| failed |" in text and "SPDL: RuntimeError: broke" in text


CHEAP_WORKLOADS = {"rows": 1.5, "ints": 1.3, "tensors": 0.6}  # with the goal of each


@pytest.mark.timeout(150)
def test_cheap_samples_quick_run_prints_its_table_and_leaves_no_process(tmp_path: Path) -> None:
    """``loader_compare.py --cheap-samples --quick`` measures each workload and contender once,
    each in a fresh process, and prints the ratio of mprs_plus over ``num_workers=0`` with its
    verdict (no figure is checked). Every process of the run carries a marker in its
    environment: none may outlive it."""
    options = ["--cheap-samples", "--quick", "--no-progress", "--out", str(tmp_path)]
    done = _loader_compare_leaving_nothing(options, f"cheap-samples-{os.getpid()}-{tmp_path.name}")

    assert "| workload | `num_workers=0` | `mprs_plus.DataLoader` | ratio of medians | goal | verdict |" in done.stdout
    assert "| workload | contender | rate | start-up ms | main CPU µs | worker CPU µs (each) | workers' sum µs |" in done.stdout
    [result_file] = tmp_path.glob("cheap-samples-*-quick.json")
    assert list(tmp_path.glob("cheap-samples-*-quick.md"))
    result = json.loads(result_file.read_text())
    assert {name: w["goal"] for name, w in result["workloads"].items()} == CHEAP_WORKLOADS
    for name, workload in result["workloads"].items():
        assert workload["verdict"] in ("PASS", "MISS"), (name, workload)
        assert workload["ratio"] > 0
        for contender in ("mprs_plus", "no_workers"):
            cell = workload["contenders"][contender]
            assert not cell["errors"] and len(cell["rate"]) == 1 and cell["rate"][0] > 0, (name, contender, cell)
    runs = result["runs"]
    assert sorted((r["workload"], r["contender"]) for r in runs) == sorted(
        (w, c) for w in CHEAP_WORKLOADS for c in ("mprs_plus", "no_workers")
    )
    for r in runs:
        assert len(r["load_before"]) == 3 and r["others_cores"] >= 0, r
        assert not r.get("left_running") and not r["killed_pids"] and not r["problem"], r
        assert r["first_batch_s"] > 0 and r["samples_timed"] == r["samples"] - {"rows": 128, "ints": 64, "tensors": 8}[r["workload"]]
        if r["contender"] == "no_workers":
            assert r["workers_cpu_per_sample"] == [] and r["main_cpu_per_sample"] > 0, r
        else:  # the workers made the samples: each one's CPU, the resource tracker not among them
            assert len(r["workers_cpu_per_sample"]) == result["settings"]["workers"], r
    [rows] = [r for r in runs if r["workload"] == "rows" and r["contender"] == "mprs_plus"]
    assert sum(rows["workers_cpu_per_sample"]) > 0


def test_start_stop_quick_run_prints_its_table_and_leaves_no_process(tmp_path: Path) -> None:
    """``loader_compare.py --start-stop --quick`` times, for mprs_plus and torch's DataLoader
    (on one workload here: the mode's driver is the cheap samples' one, tested above), two
    loaders' first batches and stops in a fresh process (no figure is checked), and leaves
    no process behind."""
    options = ["--start-stop", "--quick", "--only", "ints", "--no-progress", "--out", str(tmp_path)]
    done = _loader_compare_leaving_nothing(options, f"start-stop-{os.getpid()}-{tmp_path.name}")

    assert "| workload | contender | first batch | stop | next loader's first batch | its stop |" in done.stdout
    [result_file] = tmp_path.glob("start-stop-*-quick.json")
    result = json.loads(result_file.read_text())
    assert sorted((r["workload"], r["contender"]) for r in result["runs"]) == [("ints", "mprs_plus"), ("ints", "torch")]
    for r in result["runs"]:
        assert "error" not in r and "problem" not in r and "left_running" not in r, r
        assert all(r[f] > 0 for f in ("first_batch_s", "stop_s", "next_first_batch_s", "next_stop_s")), r


def test_cheap_samples_alternate_the_contenders_order_from_run_to_run(monkeypatch) -> None:
    """Interleaved: every run measures every contender once per workload, the first one
    alternating, so that a machine's drift hits them alike."""
    from benchmarks import cheap_samples

    seen = []

    def fake(workload, contender, workers, context, quick, timeout, module):
        seen.append((workload, contender))
        return {"workload": workload, "contender": contender, "error": "not run"}

    monkeypatch.setattr(cheap_samples, "run_one", fake)
    contenders = ("mprs_plus", "no_workers")
    records = cheap_samples.run(["rows", "ints"], contenders, 2, 2, "fork", True, progress=False)
    first, second = ("mprs_plus", "no_workers"), ("no_workers", "mprs_plus")
    assert [c for _, c in seen] == [*first, *first, *second, *second]
    assert [w for w, _ in seen] == ["rows", "rows", "ints", "ints"] * 2
    assert [r["run"] for r in records] == [0] * 4 + [1] * 4


def _record(workload: str, contender: str, rate: float, load: float = 0.1, others: float = 0.0) -> dict:
    return {
        "run": 0,
        "workload": workload,
        "contender": contender,
        "load_before": [load, load, load],
        "others_cores": others,
        "rate": rate,
        "first_batch_s": 0.03,
        "main_cpu_per_sample": 1e-6,
        "workers_cpu_per_sample": [2e-6, 2e-6] if contender == "mprs_plus" else [],
        "killed_pids": [],
        "problem": None,
    }


def test_cheap_samples_take_the_ratio_of_medians_and_warn_when_the_machine_was_busy() -> None:
    """Pure: the ratio is of the medians over runs; a failed run is left out of them and
    reported; a busy machine (load before the first run, or other processes during a run)
    is warned of."""
    from benchmarks import cheap_samples

    quiet = [_record("rows", "mprs_plus", r) for r in (900.0, 1000.0, 1100.0)]
    quiet += [_record("rows", "no_workers", r) for r in (600.0, 650.0)]
    quiet.append({**_record("rows", "no_workers", 0.0), "error": "exit status 1: boom"})
    summary = cheap_samples.summarize(quiet, ["rows"], ("mprs_plus", "no_workers"), quick=False)
    assert summary["rows"]["ratio"] == pytest.approx(1000.0 / 625.0) and summary["rows"]["verdict"] == "PASS"
    assert summary["rows"]["contenders"]["mprs_plus"]["workers_total_cpu_per_sample"] == pytest.approx([4e-6] * 3)
    assert summary["rows"]["contenders"]["no_workers"]["errors"] == ["exit status 1: boom"]
    assert cheap_samples.warnings_of(quiet) == ["run 1 rows / no_workers: exit status 1: boom"]

    loaded = [_record("rows", "mprs_plus", 1000.0, load=0.9), _record("rows", "no_workers", 900.0, others=0.8)]
    summary = cheap_samples.summarize(loaded, ["rows"], ("mprs_plus", "no_workers"), quick=False)
    assert summary["rows"]["verdict"] == "MISS"  # 1.11x against a goal of 1.5x
    text = cheap_samples.table(summary, loaded, "a headline")
    assert "| MISS |" in text
    warned = cheap_samples.warnings_of(loaded)
    assert len(warned) == 2 and all("not quiet" in w for w in warned)
    assert "0.90" in warned[0] and "0.80" in warned[1]


GRANDCHILD = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print(p.pid, flush=True)"


@pytest.mark.parametrize("hangs", [False, True], ids=["exits", "runs-past-its-timeout"])
def test_cheap_samples_measurement_leaves_no_process_behind(hangs: bool) -> None:
    """A measurement that leaves a process running when it exits, or runs past its timeout,
    is ended with its whole process group: nothing of it survives, and what had to be killed
    is reported."""
    from benchmarks import cheap_samples

    command = [sys.executable, "-c", GRANDCHILD + ("; time.sleep(600)" if hangs else "")]
    done = cheap_samples.bounded(command, timeout=3 if hangs else 60)
    assert done.timed_out == hangs
    if not hangs:
        [grandchild] = [int(line) for line in done.stdout.split()]
        assert done.returncode == 0 and done.left_running == [grandchild]
    pids = [int(line) for line in done.stdout.split()]
    assert pids or hangs  # when it hangs it may have been killed before it printed
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid


@pytest.mark.timeout(200)
def test_shared_list_benchmark_quick_run_reports_every_figure() -> None:
    """``benchmarks/shared_list.py --quick`` runs every case end to end (spawned workers
    included); no figure is checked."""
    done = _run_script("shared_list.py", "--quick", timeout=170)
    out = done.stdout
    for figure in ("build:", "read (random s[i]):", "memory: block", "list ", "shared ", "columns ", "first batch:",
                   "spawn/fork first batch:", "loader samples/s against the list's:"):
        assert figure in out, out
