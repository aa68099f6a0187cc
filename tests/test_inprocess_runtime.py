"""The runtime over a transport it was not written for: the dispatch and worker loops
(``dispatch_main``, ``worker_main``: lanes, batching, the worker's input mux, control),
and the main side's mux and in-order reader, run as threads of this process over
in-process channels (``transport/inprocess.py``). No process, no descriptor to wait on:
every multi-channel wait takes ``wait_readable``'s bounded re-check path, and the runtime
needs no change to get the same items in the same order."""

from __future__ import annotations

import copy
import itertools
import threading

import pytest
import torch.utils.data.graph as torch_graph
from torchdata.dataloader2.random import SeedGenerator
from torchdata.datapipes.iter import IterableWrapper

from mprs_plus.runtime.child import dispatch as dispatch_module
from mprs_plus.runtime.child import worker as worker_module
from mprs_plus.runtime.child.dispatch import DispatchSetup, dispatch_main
from mprs_plus.runtime.child.worker import DispatchedInput, WorkerProgram, WorkerSetup, worker_main
from mprs_plus.runtime.control_messages import Reset, pack
from mprs_plus.runtime.data_messages import Kind
from mprs_plus.runtime.main.cursor import read_in_order
from mprs_plus.runtime.mux import ChannelMux
from mprs_plus.transport import EndOfStream, wait_readable
from mprs_plus.transport.inprocess import InProcessReceiver, open_inprocess_channel

WORKERS = 2
ITEMS = 400  # many more than the channels hold: producers block on full channels


def _times_ten(x: int) -> int:
    return x * 10


def _walks_take_turns(monkeypatch) -> None:
    """torch's graph walk (``traverse_dps``: each epoch's reseeding, the sharding) pickles
    a DataPipe with a hook set on the DataPipe classes themselves, and refuses to set one
    while another is set: two threads of one process walking at once make the second raise
    ("Attempt to override existing reduce_ex_hook"). The runtime runs one child per process;
    these threads share one, so their walks take turns, one level of a graph at a time."""
    walk_one_level = torch_graph._list_connected_datapipes
    turn = threading.RLock()

    def one_at_a_time(*args, **kwargs):
        with turn:
            return walk_one_level(*args, **kwargs)

    monkeypatch.setattr(torch_graph, "_list_connected_datapipes", one_at_a_time)


def _channel(items: int = 4):
    return open_inprocess_channel(capacity_items=items, capacity_bytes=1 << 16)


def _main_mux(receivers: list[InProcessReceiver]) -> ChannelMux:
    """The main process's mux over the workers' outputs, as ``MainChannels`` feeds it."""
    index_of = {id(r): i for i, r in enumerate(receivers)}

    def recv(index: int):
        try:
            return receivers[index].recv()
        except EndOfStream:
            return (Kind.END, 1 << 62, None)

    def wait(indices: list[int]) -> list[int]:
        ready = wait_readable([receivers[i] for i in indices], timeout=20)
        assert ready, "no worker output became readable within 20 s"
        return [index_of[id(r)] for r in ready]

    return ChannelMux(receivers, recv, wait)


@pytest.mark.timeout(60)
def test_dispatch_and_worker_loops_deliver_in_order_over_in_process_channels(monkeypatch):
    # A child's set-up is for a fresh process (signals, inherited endpoints); threads skip it.
    monkeypatch.setattr(dispatch_module, "child_setup", lambda ends: None)
    monkeypatch.setattr(worker_module, "child_setup", lambda ends: None)
    _walks_take_turns(monkeypatch)  # three children in one process

    dispatch_control = _channel()
    deal = [_channel() for _ in range(WORKERS)]  # dispatcher 0 -> worker w
    worker_controls = [_channel() for _ in range(WORKERS)]
    outputs = [_channel() for _ in range(WORKERS)]  # worker w -> main
    every_end = [end for pair in (dispatch_control, *deal, *worker_controls, *outputs) for end in pair]

    placeholder = DispatchedInput("dispatcher 0", 0)
    program = WorkerProgram(outputs=(placeholder.map(_times_ten),), inputs=(placeholder,), sharding_roots=())
    setups = [
        (
            dispatch_main,
            DispatchSetup(
                sources=(IterableWrapper(range(ITEMS)),),
                num_workers=WORKERS,
                control=dispatch_control[1],
                outputs=(tuple(tx for tx, _ in deal),),
                max_items=4,
            ),
        )
    ]
    for w in range(WORKERS):
        setup = WorkerSetup(
            worker_id=w,
            num_workers=WORKERS,
            program=copy.deepcopy(program),  # each worker its own replica, as a process would get
            control=worker_controls[w][1],
            data=(outputs[w][0],),
            inputs=(deal[w][1],),
            init_fn=None,
            reset_fn=None,
        )
        setups.append((worker_main, setup))
    threads = [threading.Thread(target=main, args=(setup,), daemon=True) for main, setup in setups]
    for thread in threads:
        thread.start()

    mux = _main_mux([rx for _, rx in outputs])
    seeds = SeedGenerator(seed=7)
    try:
        # Epoch 2 is abandoned after a few items: its producers, blocked on full channels,
        # must be drained by the next epoch's reads, which then get every item in order.
        for epoch, wanted in ((1, ITEMS), (2, 5), (3, ITEMS)):
            mux.advance(epoch)
            dispatch_control[0].send(Reset(epoch, pack((seeds, None))))
            for w, (control, _) in enumerate(worker_controls):
                control.send(Reset(epoch, pack((seeds.spawn(w), None))))
            got = list(itertools.islice(read_in_order(mux, list(range(WORKERS)), epoch), wanted))
            assert got == [_times_ten(i) for i in range(wanted)]
    finally:
        # The end of each control stream is that child's STOP; its lanes then close their channels.
        for control, _ in (dispatch_control, *worker_controls):
            control.close()
        for thread in threads:
            thread.join(20)
    assert not any(thread.is_alive() for thread in threads), "a child loop did not stop"
    for _, rx in outputs:
        with pytest.raises(EndOfStream):
            while True:
                rx.recv(timeout=5)  # whatever is left, then the end the worker's lane sent
    for end in every_end:
        end.close()
