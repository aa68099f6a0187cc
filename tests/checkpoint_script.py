"""Checkpoint, then resume in another Python process, as a preempted job would.

    python checkpoint_script.py save CASES STATE_DIR    prints {case: {"reference": [4 epochs], "got": [...]}}
    python checkpoint_script.py resume CASES STATE_DIR  prints {case: {"epochs": [the rest, 3 more]}}

CASES is JSON, a config per case name; each case's state is STATE_DIR/<case>.pkl. The
cases run one after another in the one process: a resume never runs where its checkpoint
was taken, and one interpreter start serves every case. A case that raises reports
{"error": its traceback} and the others still run.

A config is JSON: pipe ("workers": shuffle and filter in the worker segment; "dispatch": a
shuffle in the dispatch segment, another in the worker segment; "main": a shuffle in the
main process), n, workers, ctx, in_order,
at (items before the checkpoint, or "end": after the whole first epoch), paused (take the
checkpoint with the loader paused by ``limit``), load ("from_state" or "load_state_dict"),
again (items after the restore before a second checkpoint, restored in turn), resume_ctx
(the start method of the restored service, if not ctx).
The reference run and the checkpointed run use seed 7; the resumed run sets no seed.
"""

from __future__ import annotations

import json
import pathlib
import pickle
import sys
import traceback

from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES
from torchdata.dataloader2 import DataLoader2
from torchdata.datapipes.iter import IterableWrapper

import mprs_plus
from mprs_plus._cli.demo import NonReplicable  # the demo's own main-process stage

# torch's filter DataPipe imports pandas on its first item wherever pandas is installed (the
# test extra brings it, with Ray Data): 0.5-0.9 s in every worker of every loader, most of
# this script's time. Imported once here, before any worker is forked, they inherit it.
try:
    import pandas  # noqa: F401
except ImportError:
    pass


def square(x: int) -> int:
    return x * x


def keep(x: int) -> bool:
    return x % 7 != 3  # uneven counts per worker: some workers end before others


def make_pipe(config: dict) -> object:
    pipe = IterableWrapper(range(config["n"])).shuffle()
    if config["pipe"] == "dispatch":
        pipe = pipe.sharding_round_robin_dispatch(SHARDING_PRIORITIES.MULTIPROCESSING)
    else:
        pipe = pipe.sharding_filter()
    pipe = pipe.filter(keep)
    if config["pipe"] == "main":
        pipe = NonReplicable(pipe)  # the shuffle and map that follow run in the main process
    return pipe.shuffle(buffer_size=8).map(square)


def make_service(config: dict, ctx: str | None = None) -> mprs_plus.MultiProcessingReadingService:
    return mprs_plus.MultiProcessingReadingService(
        num_workers=config["workers"],
        multiprocessing_context=ctx or config["ctx"],
        in_order=config["in_order"],
        worker_prefetch_cnt=4,
        timeout=60,
    )


def save(config: dict, path: str) -> dict:
    with_seed = DataLoader2(make_pipe(config), reading_service=make_service(config))
    with_seed.seed(7)
    try:
        reference = [list(with_seed) for _ in range(4)]
    finally:
        with_seed.shutdown()
    loader = DataLoader2(make_pipe(config), reading_service=make_service(config))
    loader.seed(7)
    try:
        if config["at"] == "end":
            got = list(loader)
        else:
            iterator = iter(loader)
            if config.get("paused"):
                iterator.limit(config["at"])  # DataLoader2 pauses the service after that many items
                got = list(iterator)
            else:
                got = [next(iterator) for _ in range(config["at"])]
        state = loader.state_dict()
        tail = None
        if config.get("paused"):
            tail = []
            while True:  # the checkpointed loader itself goes on as if nothing happened
                iterator.resume()
                chunk = list(iterator)  # paused again after every ``at`` items
                tail += chunk
                if len(chunk) < config["at"]:
                    break
    finally:
        loader.shutdown()
    with open(path, "wb") as file:
        pickle.dump(state, file)
    return {"reference": reference, "got": got, "tail": tail}


def resume(config: dict, path: str) -> dict:
    with open(path, "rb") as file:
        state = pickle.load(file)
    ctx = config.get("resume_ctx")  # the restored service may use another start method
    if config["load"] == "from_state":
        loader = DataLoader2.from_state(state, make_service(config, ctx))
    else:
        loader = DataLoader2(make_pipe(config), reading_service=make_service(config, ctx))
        loader.load_state_dict(state)
    head = []
    if config.get("again"):
        # A second checkpoint inside the resumed epoch, restored by yet another loader.
        try:
            iterator = iter(loader)
            head = [next(iterator) for _ in range(config["again"])]
            state = loader.state_dict()
        finally:
            loader.shutdown()
        loader = DataLoader2.from_state(state, make_service(config, ctx))
    try:
        epochs = [list(loader) for _ in range(3 if config["at"] == "end" else 4)]
    finally:
        loader.shutdown()
    epochs[0] = head + epochs[0]
    return {"epochs": epochs}


def main() -> None:
    action, cases, folder = sys.argv[1], json.loads(sys.argv[2]), pathlib.Path(sys.argv[3])
    step = save if action == "save" else resume
    results = {}
    for name, config in cases.items():
        try:
            results[name] = step(config, str(folder / f"{name}.pkl"))
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
