"""The three ways a channel endpoint stops delivering, in one vocabulary.

* ``ChannelClosed``: this endpoint was closed by its owner; using it again is a bug
  in the caller.
* ``ChannelBroken``: the peer is gone (its process died, or it closed its end without
  finishing the stream); nothing more will arrive or be accepted.
* ``EndOfStream``: the sender closed its end cleanly and every message before that
  was delivered. Not an error: the receiving loop simply ends.
"""

from __future__ import annotations


class ChannelError(Exception):
    """Base class of the transport's errors."""


class ChannelClosed(ChannelError):
    """This endpoint was closed by its owner."""


class ChannelBroken(ChannelError):
    """The peer of this endpoint is gone."""


class EndOfStream(ChannelError):
    """The sender closed the channel after its last message; all were delivered."""
