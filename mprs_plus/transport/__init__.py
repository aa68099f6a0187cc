"""Bounded one-way channels between processes. Knows nothing of DataPipes or torch.

    sender, receiver = open_channel(ctx, capacity_items=..., capacity_bytes=...)
    sender.send(obj)          # blocks while the channel is full: backpressure
    sender.close()            # end of stream
    receiver.recv(timeout)    # -> obj | raises EndOfStream / ChannelBroken / TimeoutError
    receiver.watch(sentinel)  # a ready waitable while blocked means: the sender is gone
    endpoint.release()        # drop this process's handle of an endpoint another one owns
    release_all_except(keep)  # in a forked child: drop every inherited endpoint but these

Both endpoints may be handed to a child process when it is started; each endpoint has
exactly one owner process after that.
"""

from .errors import ChannelBroken, ChannelClosed, ChannelError, EndOfStream
from .pipe import open_pipe_channel as open_channel
from .pipe import release_all_except, wait_readable

__all__ = [
    "ChannelBroken",
    "ChannelClosed",
    "ChannelError",
    "EndOfStream",
    "open_channel",
    "release_all_except",
    "wait_readable",
]
