"""The errors users see, each saying what happened, where, and what to do next."""

from __future__ import annotations


class PlanError(ValueError):
    """The DataPipe graph cannot be split into processes as written."""


class AmbiguousGraphError(PlanError):
    """A DataPipe holds references whose targets would run in different processes.

    Raised instead of silently running the pipeline in one process. The message names
    the holding class, the attribute path, and the two fixes: ``NoGraph(...)`` around
    the extra reference, or a ``get_parents()`` method that lists the real inputs.
    """


class WorkerError(RuntimeError):
    """A process of the reading service failed; the message carries the remote traceback.

    Used when the original exception type cannot be rebuilt in the main process, and for
    a ``BaseException`` that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
    ``GeneratorExit`` raised by a worker's code): raised as itself in the main process, it
    would end the training process, read as a Ctrl-C, or close a generator.
    """


class ProcessDiedError(RuntimeError):
    """A dispatch or worker process exited without being asked to."""

    # True where the message says what happened (its code could not be loaded on its
    # node), not only how the process ended: a front end then passes that on as it is.
    explained = False


class PipelineStuckError(RuntimeError):
    """The next item can never come: every process of the service waits for another.

    Raised by a read in order when the worker it waits for is starved by a dispatcher
    that waits for room at another worker, which waits for the main process (a stage
    after the dispatcher that keeps far more items on some workers than on others). The
    message names the worker and the ways out: ``in_order=False``, or balancing that stage.
    """


class ServiceClosedError(RuntimeError):
    """The reading service was shut down; a new DataLoader2 is needed to iterate again."""


class GraphvizNotFound(RuntimeError):
    """Drawing a plan as an image needs Graphviz, and part of it is missing.

    The message says which part (the ``graphviz`` Python package or the ``dot`` program)
    and how to get it; the DOT text of ``Plan.to_dot()`` needs neither.
    """
