"""The process loops and the main-side service that wires them with channels.

    service.py         main side: start, epochs, round-robin reading, stop
    dispatch.py        the dispatch process loop
    worker.py          the worker process loop
    segments.py        runnable copies of a Plan's segments
    messages.py        the message protocol and remote errors
    lifecycle.py       child set-up, parent watch, bounded shutdown
    tensor_reducer.py  tensors through the channels as raw bytes (registered on import)
"""

from . import tensor_reducer  # noqa: F401  (registers the fast tensor pickling in every process)
