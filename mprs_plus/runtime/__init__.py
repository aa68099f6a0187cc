"""The process loops, and the main-side service that wires them with channels.

Rooms by process: a module's folder says where its code runs.

    main/      the training process only
      service.py     ServiceRuntime: the facade the reading service calls; wires the children
      inprocess.py   the same surface with no child (num_workers=0)
      state.py       the one lifecycle state: NEW, PREPARED, RUNNING, STOPPING, STOPPED
      family.py      a service and its copies in this process share their statistics
      topology.py    which children exist, their channels and statistics rows, by name
      supervisor.py  starts the children, sends control messages, stops them
      handles.py     a child as torch's loader shows its workers (pid, is_alive(), join())
      lifecycle.py   bounded stop (join -> terminate -> kill), exit hook, death errors
      reader.py      the epoch, one mux over every worker output, death diagnosis
      cursor.py      reads of one worker output, in order or as ready; what was handed out
      gate.py        reads versus a stop from another thread
      stats.py       the main process's view of the statistics table
      restore.py     checkpoint capture and restore
      diagnose.py    what in a segment cannot be pickled
      feeding.py     pin_memory / device=: page-locked lend areas, copies ahead on a side stream
      replacement.py worker_restarts: the budget, the poison rule, what a replacement says
      oom.py         the cgroup's count of out-of-memory kills, read around a death
    child/     a dispatch or worker process only
      worker.py      the worker process: one replica of the worker segment
      dispatch.py    the dispatch process: deals items round-robin to the workers
      loop.py        lanes that produce, a listener that reads control messages
      lanes.py       what each lane produces and where it writes
      redeal.py      worker_restarts: a dispatch lane that deals a replaced worker its epoch again
      batching.py    items bound for one channel, in batches
      control.py     how a child applies control messages to its segment copy
      seeding.py     numpy's global generator seeded per epoch, loaded only if used
      lifecycle.py   what a child does first (SIGINT, parent watch, threads)
      allocator.py   glibc's malloc thresholds pinned, so large samples reuse the heap
    (here)     both sides
      control_messages.py  main -> child: Reset, Pause, Resume, Limit, Redeal
      data_messages.py     child -> next process: items, end, remote errors
      mux.py               several channels read as one
      liveness.py          which child lanes sleep in a channel wait (a stuck read's evidence)
      window.py            items a worker lane may produce beyond those handed out (prefetch_factor)
      generators.py        a worker's generators as its epoch began, for its replacement
      pausing.py           pause/resume a segment's DataPipes, in graph order
      segments.py          runnable copies of a Plan's segments (built in main, run in children)
      stats.py             the shared statistics table and its writers
      timeline.py          the timeline's rings of spans, one per lane (timeline=True)
      private_memory.py    a process's private and resident memory, sampled rarely (stats.py)
      tensor_reducer.py    tensors through the channels as raw bytes (registered on import)

The child side and the shared modules never import the main side
(``tests/test_architecture.py`` proves it from the source).
"""

from . import tensor_reducer  # noqa: F401  (registers the fast tensor pickling in every process)
