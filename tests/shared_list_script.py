"""Build a SharedList, hand it to a spawned child, and die by SIGKILL.

    python shared_list_script.py N METHOD    prints "built", then the child prints "read SUM"

The child gets the list in its start arguments (METHOD: spawn or forkserver), waits until
this process is gone, then reads every item: the memory it holds was handed over with the
child's start, not left behind under a name. Run with ``MPRS_PLUS_LEND_MEMORY`` to force the
kind of memory (``test_shared_list.py`` does, and checks that nothing is left behind).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

from mprs_plus import SharedList


def read_after_parent_died(items: SharedList) -> None:
    parent = multiprocessing.parent_process()
    parent.join(60)  # waits on the parent's sentinel: returns as soon as it is gone
    print("parent gone" if not parent.is_alive() else "parent alive", flush=True)
    print(f"read {sum(item['label'] for item in items)}", flush=True)


if __name__ == "__main__":
    n, method = int(sys.argv[1]), sys.argv[2]
    records = SharedList({"path": f"/data/{i}.jpg", "label": i} for i in range(n))
    child = multiprocessing.get_context(method).Process(target=read_after_parent_died, args=(records,))
    child.start()
    print("built", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
