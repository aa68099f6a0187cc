"""The process loops and the main-side service that wires them with channels.

    service.py    main side: start, epochs, round-robin reading, stop
    dispatch.py   the dispatch process loop
    worker.py     the worker process loop
    segments.py   runnable copies of a Plan's segments
    messages.py   the message protocol and remote errors
    lifecycle.py  child set-up, parent watch, bounded shutdown
"""
