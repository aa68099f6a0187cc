"""Warnings that name the user's line.

A warning about how the service is used (a plan's footgun, ``pin_memory=True`` without an
accelerator) is issued deep in a call that came from the user's code through torchdata's
``DataLoader2`` (and torch's DataPipe hooks), or through a trainer that iterates the loader
(Lightning, Accelerate's wrapper, Transformers' ``Trainer``). A fixed ``stacklevel`` names
whichever frame happens to sit that many levels up, often
``torchdata/dataloader2/dataloader2.py``; the depth differs by front end and by call path.
``warn`` instead walks out of every frame of mprs_plus, torchdata, torch and those
trainers, and attributes the warning to the first frame beyond them: the user's line
(``trainer.fit(...)``, or the interpreter's top level, when nothing else is left).
"""

from __future__ import annotations

import os
import sys
import warnings

# Packages whose frames are never the user's.
_LIBRARIES = (
    "mprs_plus",
    "torchdata",
    "torch",
    # Trainers that iterate a loader for the user.
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "accelerate",
    "transformers",
)


def _library_folders() -> tuple[str, ...]:
    folders = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)  # only those loaded can be on the stack
        path = getattr(module, "__file__", None)
        if path:
            folders.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(folders)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` called by the caller of this
    function name the first frame outside mprs_plus, torchdata, torch and the trainers."""
    folders = _library_folders()
    frame = sys._getframe(1)  # the function that will call warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(folders):
        frame = frame.f_back
        level += 1
    return level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)``, attributed to the user's line."""
    warnings.warn(message, category, stacklevel=user_stacklevel())
