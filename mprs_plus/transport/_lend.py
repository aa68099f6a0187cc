"""Large buffers handed over without a copy in the receiver: the channel's lend area.

Why
    Copying a buffer out of the ring costs the receiving process a pass over every byte.
    In the main process of a data loader that one core then caps the bandwidth, however
    many workers produce. So a large out-of-band buffer is not put in the ring: the sender
    copies it into the channel's *lend area* (the part of the shared region after the
    ring, see ``_memory.py``) and the frame carries only where it is. The receiver hands
    the user an array that *is* that memory, and the extent goes back to the sender when
    the user drops the last reference to it: one copy in the producer, none in the
    consumer.

::

    sender (LendArea)                         receiver (LentViews)
    reserve: a free extent + a free slot;
             slot state = LENT
    copy the buffer into the extent
    frame: [length | LENT_BIT] [offset, slot] -->  root = uint8 ndarray over the extent
                                                   weakref(root) dies -> slot state = FREE
    reap: slots whose state is FREE give
          their extents back to the free list

Who writes a slot's state word (``SLOT_BASE + slot`` in the control page)
    The sender sets it to LENT only while it is FREE (the slot is its own then); the
    receiver sets it to FREE only once nothing can read the extent any more: the root
    array and everything built on it are gone, the bytes were copied out, or the message
    was skipped unread. The receiver's reads of the extent come before its store of FREE,
    and the sender's check of FREE before its writes: x86-64 never reorders a load with a
    later store, so the two never overlap.

    The pipe transport (``pipe.py``) keeps the same states without sharing the words: the
    sender keeps its own, and the receiver's store of FREE is a message to it through a
    pipe, which the kernel orders on every processor. Both ends use the classes below
    unchanged; ``LentViews`` takes where to store FREE, ``LendArea`` where to read it.

Why the root is an ndarray
    Every view built on the buffer must keep the root alive, whatever the library does
    with it: numpy ``frombuffer``/``view``/``reshape``, ``torch.frombuffer``/``from_numpy``,
    ``memoryview``, pickle's read-only buffers. A memoryview root fails that test (numpy
    and pickle re-export the memory behind it and drop it); an ndarray whose own base is
    not an ndarray passes it, and takes weak references. ``tests/transport`` checks each
    of these paths.

Bounds: memory stays bounded, and no consumer can stall a producer
    * In flight. Lent bytes sent and not yet read are bounded by ``lent_ahead``:
      ``LENT_AHEAD``, or two messages' worth where the messages are larger, and never
      more than the ring's size. The sender waits (the channel's usual wait for room,
      woken by the receiver's reads) while ``sent - read`` of them would pass it. A
      message larger than that goes when nothing lent is in flight. The bound is what a
      producer's pages come to: the extents in flight, the one it builds and those the
      user holds are all it ever writes (free extents are taken before fresh space), and
      each page it wrote is one more for its exit to unmap (a stop waits for that) and
      for the channel to keep.
    * Held. A receiver lends at most ``HOLD_FACTOR`` times the ring's size in buffers
      its user still holds (counted from when they are read: a batch of items waiting to
      be yielded counts too), and always at least one buffer; past that it copies the buffer out and gives the
      extent back at once. So ``list(loader)`` keeps copies, not extents, and the sender
      always gets extents back from what is in flight.
    * The area is ``LEND_FACTOR`` times the ring: room for both bounds, and slack for
      fragmentation. If the sender still finds no extent (or no free slot, ``SLOTS``), the
      buffer goes through the ring, copied: the sender never waits for the user.
    * Buffers under ``LEND_MIN`` bytes are copied: for them a copy costs less than the
      bookkeeping.

Fork: a child keeps the bytes it inherited, and its writes stay its own
    A forked child inherits the lent views as views of the same ``MAP_SHARED`` pages, not
    as copy-on-write memory: without more, the parent's sender would refill an extent the
    parent gave back under the child, and the child's writes would reach the parent. So,
    in any process that lends (the main process, a worker fed by a dispatcher):

    before fork       the buffers lent now are *pinned*, and so is any lent until the
                      fork returns: when the parent drops one, its extent is not given
                      back yet. A pipe is made for the child to close.
    child, at once    each lent buffer it inherited gets private pages at the same
                      address holding the same bytes (a copy into a fresh anonymous
                      mapping, ``mremap``-ed over the extent); then it closes the pipe
    parent, later     once every such pipe reads end of file (checked when a buffer is
                      lent or dropped, and by ``lending()``), the pinned extents dropped
                      meanwhile go back to the sender

    The child pays one copy of the lent bytes held at the fork, and keeps them as private
    memory; the parent pays only extents held back until the child has copied. A child
    that could not remap (the kernel refused a mapping) writes a byte before it closes the
    pipe, and the parent then never gives those extents back.

Page-locked lend areas: a copy to a device may still read an extent the user dropped
    A process that installs a ``PageLocker`` (``lock_pages_with``; the runtime does, in the
    training process, for ``pin_memory=True``, for the receivers it makes inside
    ``pinning_receivers()`` only) page-locks the lend area of each such receiver as it
    lends from it, one chunk at a time (``lock_chunk_ends``: chunks that
    double in size, each locked when a buffer is first lent from it; the sender never
    places an extent across two, nor lends a buffer larger than the largest), so that
    the memory locked follows what the channel uses, and every lent buffer is page-locked
    memory of one registration and
    a non-blocking copy to the device reads the worker's bytes directly.

    Only an area that will be locked is cut so: the sender must know before its first
    extent, and its receiver may live in another process by then. So the decision is
    made as the channel is made (``lay_out_area``: inside ``pinning_receivers()``, or
    while a locker locks every receiver) and kept in the control page (``LOCK_CHUNKED``),
    where both ends read it. Any other area is one chunk, and one buffer may take all of
    it (a buffer over half the area is lent, not copied); a receiver that locks such an
    area anyway (it was made inside ``pinning_receivers()`` though its channel was not)
    locks all of it at its first lend. A replacement's channels, opened later, are opened
    as the first ones were (``pinning_as_now``).

    Such a copy runs
    after the call that enqueued it returned: the user may drop the last view while the
    device still reads it. So when a lent root dies in such a process, the locker is
    asked for a *fence* (events recorded on the current streams) and the extent goes back
    to the sender only once the fence has *passed*: checked whenever a buffer is lent,
    copied or dropped, and by ``lending()``, never by blocking on the device. A fence the
    locker could not make, or could not tell about, has not passed. Until then
    the extent counts against the held-bytes bound, so memory stays bounded, and the
    mapping stays mapped (a view of it is kept with the fence). The area is unlocked
    before it is unmapped: when the channel is released and nothing of it is held or
    awaiting a fence. A copy enqueued on a stream other than the current one at the drop
    is for its user to order (as with ``Tensor.record_stream``). Buffers copied instead of
    lent are copied into memory the locker allocates (page-locked too). A forked child
    never calls the locker: it is the parent's (the child inherits no device context).

Built in place: a sender's own process writes a buffer straight into an extent
    ``LendArea.borrow(nbytes)`` reserves an extent for the sending process itself and
    returns a writable uint8 ndarray over it (the *root*, as above), or None at once when
    there is no lend area, no free extent or slot, the buffer would be under
    ``LEND_MIN``, or the sender's unsent borrowed bytes would pass the ring's size: it
    never waits. The producer builds its buffer in that memory (a batch stacked there).
    When a message then carries an out-of-band buffer that lies within a borrowed extent
    (``reserve`` compares addresses), the frame names that extent and ``fill`` copies
    nothing: the bytes are where the receiver reads them already. An extent is sent this
    way once; a second buffer in it (or in it again) is copied as any other.

    The extent goes back to the free list only when both are done with it: the
    receiver (its state word FREE, as for any lent buffer) and the producer (its root
    died: a weak reference). A borrowed extent that is never sent (the batch was dropped,
    the collate function raised later, the process stops) thus goes back once its root
    dies, and a sent one is never refilled under a producer that still holds it. The
    weak reference's callback only marks the borrow dead; ``reap``, in the sending
    thread, returns the extent. Only the thread that sends may borrow (the area has one
    writer). A child forked while the producer holds a borrowed root gets private pages
    for it, as for a lent one, and its extent waits for that copy.

``lending()`` reports what this process's receivers did; ``stats()`` of the service shows
it for the main process. A sender counts the large buffers it sent built in place and
those it copied in, in the control page (``LENT_IN_PLACE``, ``LENT_COPIED``), so that
``traffic()`` reports them at both ends.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

from . import streaming
from ._memory import PAGE, SharedRegion
from .traffic import Lending

T = TypeVar("T")

# Bytes; smaller buffers are copied through the ring. Below this size lending saved the
# receiver nothing and copying went faster; from it on, lending saves the receiver CPU,
# more the larger the buffer (figures in docs/benchmarks-history.md, Design figures).
LEND_MIN = 128 << 10
# Lent bytes a sender may have sent and not seen read yet (``lent_ahead``: two messages'
# worth where they are larger, the ring's size at most), as torch's prefetch_factor of 2
# keeps for batches of 8 MiB. 1 MiB tensors in batches of 8 ran at 14.5-14.7 GB/s with
# either 16 or 64 MiB (2 workers, 6 runs each), and a worker's exit then unmapped about
# 30 MiB of channel pages rather than 80: the stop of an iterator took 18.9 ms (median of
# 24) against 23.9.
LENT_AHEAD = 16 << 20
HOLD_FACTOR = 2  # a receiver lends its user up to this many times the ring at a time
LEND_FACTOR = 4  # the lend area is this many times the ring: in flight, held, and slack
SLOTS = 256  # extents one channel can have lent at a time
SLOT_BASE = 64  # control word of slot 0's state (lines 0-3 are the ring's, _ring.py)
# Control words the sender counts its large buffers in, built in place and copied in
# (line 4; the pipe transport's control page uses them too), so both ends report them.
LENT_IN_PLACE, LENT_COPIED = 32, 33
# An area that will be page-locked is locked in chunks, each as it is first lent from:
# this many at most, each twice the one before (the first two equal), so that what is
# locked stays within twice what the channel has used. The sender never places an extent
# across two chunks. Any other area is one chunk: an extent may be as large as the area.
LOCK_CHUNKS = 6
# Control word (line 5) set once as the channel is made, before either end exists: 1 when
# its area is laid out in lock chunks (``lay_out_area``). Both ends read it, in any process.
LOCK_CHUNKED = 40
FREE, LENT = 0, 1
LENT_BIT = 1 << 63  # in a buffer's length word: the frame holds [offset, slot], not bytes
DESCRIPTOR = 16  # bytes of [offset, slot] in a frame



def lock_chunk_ends(capacity: int, chunked: bool = True) -> list[int]:
    """Where each lock chunk of a lend area of ``capacity`` bytes ends (page-aligned; the
    last at ``capacity``); an area not ``chunked`` is one chunk. Sender and receiver
    compute the same list (``chunk_ends_of``)."""
    if not chunked:
        return [capacity]
    first = max(PAGE, (capacity >> (LOCK_CHUNKS - 1)) // PAGE * PAGE)
    ends, end = [], first
    while end < capacity:
        ends.append(end)
        end *= 2
    ends.append(capacity)
    return ends


def lay_out_area(region: SharedRegion) -> None:
    """Decide, as a channel is made (before its ends), whether its lend area is cut into
    lock chunks: only if a receiver made here and now would page-lock it. Chunks cost the
    sender its largest extents (a buffer over half the area is copied through the ring),
    so an area nobody locks stays one piece."""
    if region.lend_size:
        region.ctl[LOCK_CHUNKED] = int(_locks_receivers_made_now())


def chunk_ends_of(region: SharedRegion) -> list[int]:
    """``lock_chunk_ends`` of ``region``'s lend area, as ``lay_out_area`` laid it out."""
    return lock_chunk_ends(region.lend_size, bool(region.ctl[LOCK_CHUNKED]))


class PageLocker(Protocol):
    """What a receiver needs to lend page-locked memory (see the module's docstring). The
    transport knows nothing of devices: the runtime implements this with the device's
    calls, and tests with a fake whose fences pass when the test says so."""

    def register(self, address: int, nbytes: int) -> bool:
        """Page-lock ``[address, address + nbytes)``; False if it could not (lend unlocked)."""

    def unregister(self, address: int) -> None:
        """Undo ``register`` of the range starting at ``address`` (before it is unmapped)."""

    def fence(self) -> Any:
        """A token for the device work enqueued so far on the current stream."""

    def passed(self, token: Any, blocked: set[Any]) -> bool:
        """Whether that work has finished (never blocks; one that raises has not).
        ``blocked``: one set per look over the waiting fences, in the order they were
        made, for the locker to note what has not passed (a stream), so that it need not
        ask about later fences behind it."""

    def allocate(self, nbytes: int) -> Any:
        """A writable buffer of ``nbytes`` page-locked bytes, for a buffer copied out."""


_locker: PageLocker | None = None
_marked_only = False  # lock only the receivers made inside ``pinning_receivers()``
_marking = threading.local()  # .depth: how many ``pinning_receivers()`` this thread is inside


def lock_pages_with(locker: PageLocker | None, marked_only: bool = False) -> None:
    """From now on, receivers of this process lend page-locked memory through ``locker``
    (None: receivers that lend from now on do not lock): every receiver, or with
    ``marked_only`` those made inside ``pinning_receivers()`` (the channels of a loader
    that asked for pinning, not those of another loader in the same process). A forked
    child starts with None."""
    global _locker, _marked_only
    _locker, _marked_only = locker, marked_only


@contextlib.contextmanager
def pinning_receivers() -> Iterator[None]:
    """Receivers made in this context (on this thread) are page-locked while a locker is
    installed with ``marked_only``, and the channels opened in it have their lend areas
    cut into lock chunks (``lay_out_area``)."""
    _marking.depth = getattr(_marking, "depth", 0) + 1
    try:
        yield
    finally:
        _marking.depth -= 1


def _marked_now() -> bool:
    return bool(getattr(_marking, "depth", 0))


def _locks_receivers_made_now() -> bool:
    return _marked_now() or (_locker is not None and not _marked_only)


def pinning_as_now(function: Callable[..., T]) -> Callable[..., T]:
    """``function``, which opens channels later (a replacement worker's), made to open them
    as they would be opened here and now: inside ``pinning_receivers()`` if this thread is
    inside it now, so that they are page-locked and laid out as the first ones were."""
    if not _marked_now():
        return function

    @functools.wraps(function)
    def marked(*args: Any, **kwargs: Any) -> T:
        with pinning_receivers():
            return function(*args, **kwargs)

    return marked


class _Holding:
    """Process-wide counters and fork state. The lock is held for a few integer
    operations only, never across anything that can run a finalizer, so a release from
    any thread is safe.

    The fork state is changed by single operations on an int, a set or a list, each
    atomic under the GIL, in an order where a race at worst holds an extent back until
    the next ``_settle``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lent = self.copied = self.held_buffers = self.held_bytes = 0
        # id of the weak reference to a root -> (that reference, its receiver's views,
        # slot, length). Keyed by id: a weak reference hashes as its referent, and arrays
        # do not hash.
        self.roots: dict[int, tuple[weakref.ref[Any], LentViews, int, int]] = {}
        self.receivers: weakref.WeakSet[LentViews] = weakref.WeakSet()  # that may lend
        self.forking = 0  # forks between their before and after hooks
        self.fork_pipes: dict[int, tuple[int, int]] = {}  # thread -> pipe of its fork under way
        self.copying: list[int] = []  # read ends of pipes some child has not closed yet
        self.pinned: set[int] = set()  # keys of live roots a child may still be copying
        self.deferred: list[tuple[LentViews, int]] = []  # pinned, dropped: (views, slot)
        self.kept: set[int] = set()  # keys of roots whose extents never go back
        # Roots dropped in a page-locking receiver, waiting for their fence:
        # (key, views, slot, length, fence token, a view that keeps the mapping mapped).
        self.awaiting: list[tuple[int, LentViews, int, int, Any, memoryview]] = []
        self.reaping = threading.Lock()  # held by the one reaper of ``awaiting`` (never waited for)
        # Extents borrowed by this process's senders whose roots live: id of the weak
        # reference to the root -> (that reference, its borrow).
        self.borrowed: dict[int, tuple[weakref.ref[Any], _Borrow]] = {}


_holding = _Holding()


def _before_fork() -> None:
    """Pin what is lent now, and (``LentViews.take``) what is lent until the fork returns."""
    h = _holding
    if not h.roots and not h.receivers and not h.borrowed:
        return  # nothing is lent, and nothing can be before the fork
    _libc()  # loaded here, so that the child only copies
    h.fork_pipes[threading.get_ident()] = _fork_pipe()
    h.forking += 1
    h.pinned.update(h.roots)
    h.pinned.update(id(borrow) for _ref, borrow in list(h.borrowed.values()))


def _fork_pipe() -> tuple[int, int]:
    """A non-blocking pipe closed on exec: ``pipe2`` where the system has it (Linux), else
    ``pipe`` (Python makes its ends non-inheritable) and then non-blocking."""
    if hasattr(os, "pipe2"):
        return os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    os.set_blocking(write_end, False)
    return read_end, write_end


def _after_fork_in_parent() -> None:
    h = _holding
    pipe = h.fork_pipes.pop(threading.get_ident(), None)
    if pipe is None:
        return
    read_end, write_end = pipe
    os.close(write_end)
    h.forking -= 1
    if h.pinned or h.deferred:
        h.copying.append(read_end)
        _settle()
    else:
        os.close(read_end)  # nothing was lent at the fork: nothing to wait for


def _after_fork_in_child() -> None:
    """Give every inherited lent buffer private pages, tell the parent, start afresh.

    The parent's lent buffers are the parent's to give back: if the child dropped or
    collected one, its ``_give_back`` would free an extent the parent still reads (and,
    once the sender reused it, free the next buffer lent there too). With a new
    ``_Holding`` the old weak references' callbacks never run here; and it has a new lock,
    as a fork may have copied the old one while another thread held it."""
    global _holding, _locker
    inherited = _holding
    _holding = _Holding()
    _locker = None
    if not inherited.fork_pipes:
        return
    failed = False
    roots = [ref for ref, _views, _slot, _length in list(inherited.roots.values())]
    roots += [ref for ref, _borrow in list(inherited.borrowed.values())]
    for ref in roots:
        root = ref()
        if root is not None and not _privatize(root.__array_interface__["data"][0], root.nbytes):
            failed = True
    for read_end in inherited.copying:
        os.close(read_end)
    for read_end, write_end in inherited.fork_pipes.values():
        os.close(read_end)
        if failed:
            try:
                os.write(write_end, b"!")
            except OSError:
                pass  # the parent then sees a plain end of file: nothing better to do
        os.close(write_end)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def _settle() -> None:
    """Once every child forked while buffers were pinned has its own copies, give back
    the pinned extents dropped meanwhile, and pin nothing more."""
    h = _holding
    if h.forking:
        return  # a fork is under way: what is pinned stays so until it returns
    waiting, failed = [], False
    for read_end in h.copying:
        try:
            failed = bool(os.read(read_end, 1)) or failed
        except BlockingIOError:
            waiting.append(read_end)
            continue
        os.close(read_end)
    h.copying = waiting
    if failed:
        h.kept.update(h.pinned)  # a child may read these extents as long as it lives
        h.pinned.clear()
        h.deferred = []
    if waiting:
        return
    h.pinned.clear()
    deferred, h.deferred = h.deferred, []
    for views, slot in deferred:
        _free(views, slot)


_LIBC: Any = None
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_MAP_FAILED = (1 << 64) - 1
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)  # 0x10 on Linux and the BSDs (macOS) alike


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        mremap = getattr(libc, "mremap", None)  # Linux only; see _privatize
        if mremap is not None:
            mremap.restype = ctypes.c_void_p
            mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        _LIBC = (libc, ctypes.memmove, mremap)
    return _LIBC


def _privatize(address: int, nbytes: int) -> bool:
    """Replace the shared pages under ``[address, address + nbytes)`` by private ones
    holding the same bytes; False if the kernel refused. An extent is whole pages of its
    own, so no other buffer's bytes share the pages remapped.

    Linux moves a filled private mapping over the extent (``mremap``): one copy. Where
    there is no ``mremap`` (macOS), the bytes are copied aside, a private mapping is put
    at the extent's address (``MAP_FIXED``, POSIX) and they are copied back: two."""
    libc, memmove, mremap = _libc()
    size = -(-nbytes // PAGE) * PAGE
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if mremap is None:
        import ctypes

        holder = (ctypes.c_char * nbytes).from_buffer(bytearray(nbytes))
        memmove(holder, address, nbytes)
        if libc.mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags | _MAP_FIXED, -1, 0) != address:
            return False
        memmove(address, holder, nbytes)
        return True
    fresh = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if fresh is None or fresh == _MAP_FAILED:
        return False
    memmove(fresh, address, nbytes)
    if mremap(fresh, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, address) != address:
        libc.munmap(fresh, size)
        return False
    return True


def lending() -> Lending:
    """What this process's receivers lent and copied so far, and what is held now."""
    h = _holding
    if h.copying:
        _settle()
    if h.awaiting:
        _reap_awaiting()
    with h.lock:
        return Lending(h.lent, h.copied, h.held_buffers, h.held_bytes, len(h.awaiting))


def _give_back(ref: weakref.ref[Any]) -> None:
    """The root of a lent buffer died: its extent is the sender's again, unless a child
    forked while it lived may still be copying it."""
    h = _holding
    key = id(ref)
    entry = h.roots.pop(key, None)
    if entry is None:
        return
    _, views, slot, length = entry
    locker = views.locker
    if locker is not None:
        # The dying root still holds the mapping: a view taken now keeps it mapped until
        # the fence passes, whatever happens to the channel meanwhile. The record is whole
        # before it is appended: making the fence runs device calls (and may run a
        # finalizer that reaps), and the list appended to must be read only after them.
        guard = memoryview(views.locked_mapping)  # type: ignore[arg-type]
        record = (key, views, slot, length, _fence(locker), guard)
        h.awaiting.append(record)
        _reap_awaiting()
        return
    _returned(key, views, slot, length)


_UNRECORDED = object()  # a fence the locker failed to make: made again at the next look


def _fence(locker: PageLocker) -> Any:
    try:
        return locker.fence()
    except Exception:
        return _UNRECORDED


def _reap_awaiting() -> None:
    """Give back the extents whose fences have passed. A fence that could not be made or
    asked has not passed: it is made again (a later fence orders after the same work) or
    asked again at the next look.

    One reaper at a time, and the list is never replaced: a fence is appended (any
    thread, or a finalizer inside a reaper's device call) at its end, and the reaper
    rewrites only the part it looked at (one slice assignment, atomic under the GIL).
    A second reaper (another thread, or a finalizer that runs inside this one) leaves
    at once: what it would give back is given back now or at the next look. No lock is
    waited for, so a finalizer on the reaper's own thread cannot deadlock."""
    h = _holding
    if not h.reaping.acquire(blocking=False):
        return
    try:
        entries = h.awaiting
        count = len(entries)
        waiting, done = [], []
        blocked: set[Any] = set()  # the locker's note of streams not passed yet, for this look
        for entry in entries[:count]:
            token, locker = entry[4], entry[1].locker
            if locker is not None and token is _UNRECORDED:
                entry = (*entry[:4], _fence(locker), entry[5])
                waiting.append(entry)
                continue
            try:
                finished = locker is None or locker.passed(token, blocked)
            except Exception:
                finished = False
            (done if finished else waiting).append(entry)
        entries[:count] = waiting
    finally:
        h.reaping.release()
    for key, views, slot, length, _token, guard in done:
        _returned(key, views, slot, length)
        guard.release()


def _returned(key: int, views: LentViews, slot: int, length: int) -> None:
    """Nothing reads the extent of a dropped root any more (in this process)."""
    h = _holding
    with h.lock:
        h.held_buffers -= 1
        h.held_bytes -= length
        views.held -= length
    if key in h.pinned:
        h.pinned.discard(key)
        h.deferred.append((views, slot))
        _settle()
    elif key in h.kept:
        h.kept.discard(key)
    else:
        _free(views, slot)
    if views.retired and not views.held:
        views.unlock()


def _free(views: LentViews, slot: int) -> None:
    try:
        views.ctl[SLOT_BASE + slot] = FREE
    except ValueError:
        pass  # the channel was released here: nobody is left to give it back to


class _Borrow:
    """An extent ``LendArea.borrow`` lent to its own process: where, how long, and whose
    it is now (the module's docstring, Built in place)."""

    __slots__ = ("slot", "offset", "nbytes", "sent", "alive")

    def __init__(self, slot: int, offset: int, nbytes: int) -> None:
        self.slot = slot
        self.offset = offset
        self.nbytes = nbytes
        self.sent = False  # a frame published it: the receiver gives it back, as any lent buffer
        self.alive = True  # the producer's root lives: the extent is not refilled under it


def _borrow_dropped(ref: weakref.ref[Any]) -> None:
    """The root of a borrowed extent died (any thread): mark it; ``reap`` returns it."""
    entry = _holding.borrowed.pop(id(ref), None)
    if entry is not None:
        entry[1].alive = False


def _forked_copy_pending(borrow: _Borrow) -> bool:
    """A child forked while ``borrow``'s root lived may still be copying its extent (or
    could not, and may read it as long as it lives)."""
    h = _holding
    key = id(borrow)
    if key in h.pinned:
        _settle()
    return key in h.pinned or key in h.kept


def lent_ahead(ring_bytes: int, planned: int) -> int:
    """Lent bytes in flight, a message of ``planned`` of them included, that a sender may
    have: ``LENT_AHEAD``, or two such messages where they are larger (torch's
    prefetch_factor keeps two batches a worker), and never more than the ring's size.
    A message that passes it alone goes when nothing lent is in flight."""
    return min(ring_bytes, max(LENT_AHEAD, 2 * planned))


class LendArea:
    """The sender's side: which extents of the area are free, and which slots lend what.

    Extents are page-aligned. A best-fit free list first, then space never used (a bump
    pointer), then coalescing of neighbours; freed extents are found by reading the state
    words of the lent slots (``reap``), which costs the receiver nothing.

    ``region`` (the channel's mapping) lets the area lend extents to its own process
    (``borrow``); without it, ``borrow`` gives None."""

    def __init__(self, ctl: memoryview, area: memoryview, region: SharedRegion | None = None) -> None:
        self._ctl = ctl
        self._area = area
        self._region = region
        self._capacity = area.nbytes
        # One chunk, unless the channel was made to be page-locked (``lay_out_area``).
        self._chunk_ends = chunk_ends_of(region) if region is not None else [self._capacity]
        self._largest = max(end - start for start, end in zip([0, *self._chunk_ends], self._chunk_ends))
        self._top = 0
        self._free: list[tuple[int, int]] = []  # (offset, size)
        self._lent: dict[int, tuple[int, int]] = {}  # slot -> (offset, size)
        self._slots = list(range(SLOTS - 1, -1, -1))
        self._borrows: dict[int, _Borrow] = {}  # slot -> the borrow it lends, while it does
        # Those of them no frame has published yet, the latest last: a worker runs dozens
        # of batches ahead, and scanning every borrow twice per batch cost it ~10 us.
        self._unsent: dict[int, _Borrow] = {}
        self._placed: list[_Borrow] = []  # borrows the frame being sent publishes in place
        self._base = -1  # the area's address in this process, once a borrow needed it
        self._frombuffer: Any = None
        self._uint8: Any = None
        # Unsent borrowed bytes are held to the ring's size (a quarter of the area), so
        # that what a producer builds ahead never takes the room lending needs.
        self._borrow_limit = self._capacity // LEND_FACTOR
        # Large buffers sent from the extent they were built in (no copy), and copied into
        # an extent: counted in the control page, where both ends read them.
        self._figures = region.ctl if region is not None else None
        # An endpoint that lent buffers in another process before it was handed here
        # (the service never does this) does not know which extents are still held:
        # it sends through the ring rather than risk lending one of them again.
        self._inherited = any(ctl[SLOT_BASE + slot] != FREE for slot in range(SLOTS))

    @staticmethod
    def planned(buffers: list[memoryview]) -> int:
        """Bytes of ``buffers`` that are large enough to be lent."""
        return sum(b.nbytes for b in buffers if b.nbytes >= LEND_MIN)

    def borrow(self, nbytes: int) -> Any | None:
        """A writable uint8 ndarray of ``nbytes`` over a reserved extent, for this process
        to build a buffer in and then send (the module's docstring, Built in place); None
        at once when there is no room, no mapping, or ``nbytes`` is under ``LEND_MIN``.
        Only the sending thread may call it."""
        region = self._region
        if self._inherited or nbytes < LEND_MIN or region is None or region.mapping is None:
            return None
        unsent = sum(b.nbytes for b in self._unsent.values() if b.alive)
        if unsent and unsent + nbytes > self._borrow_limit:
            return None
        place = self._reserve_one(nbytes)
        if place is None:
            return None
        offset, slot = place
        if self._frombuffer is None:
            import numpy

            self._frombuffer, self._uint8 = numpy.frombuffer, numpy.dtype(numpy.uint8)
        # Over the mapping itself, not a view of it: the region can release its views
        # while the root lives, and the root alone then keeps the memory mapped.
        root = self._frombuffer(region.mapping, self._uint8, nbytes, region.lend_start + offset)
        if self._base < 0:
            self._base = root.__array_interface__["data"][0] - offset
        borrow = self._borrows[slot] = self._unsent[slot] = _Borrow(slot, offset, nbytes)
        h = _holding
        ref = weakref.ref(root, _borrow_dropped)
        h.borrowed[id(ref)] = (ref, borrow)
        if h.forking:
            h.pinned.add(id(borrow))  # another thread forks now: the child may inherit it
        return root

    def reserve(self, buffers: list[memoryview]) -> list[tuple[int, int] | None] | None:
        """An (offset, slot) per buffer that goes through the area, None per buffer that
        goes through the ring; None when none is lent. Reserved slots are LENT from now on:
        ``fill`` them, or ``unreserve`` them if the frame is not sent. A buffer that lies
        in an extent borrowed and not sent yet is placed there, where it is already."""
        self._placed = []
        if self._inherited:
            return None
        places: list[tuple[int, int] | None] = []
        any_lent = False
        for buffer in buffers:
            place = None
            if buffer.nbytes >= LEND_MIN:
                if self._unsent:
                    place = self._built_here(buffer)
                if place is None:
                    place = self._reserve_one(buffer.nbytes)
            places.append(place)
            any_lent = any_lent or place is not None
        return places if any_lent else None

    def _built_here(self, buffer: memoryview) -> tuple[int, int] | None:
        """(offset, slot) of the unsent borrowed extent ``buffer`` lies in, marked sent."""
        if self._base < 0:
            return None
        address = self._frombuffer(buffer, self._uint8).__array_interface__["data"][0]
        offset = address - self._base
        if not 0 <= offset < self._capacity:
            return None
        end = offset + buffer.nbytes
        for borrow in reversed(self._unsent.values()):  # the latest is the usual one
            if borrow.offset <= offset and end <= borrow.offset + borrow.nbytes:
                borrow.sent = True
                del self._unsent[borrow.slot]  # and the loop ends here
                self._placed.append(borrow)
                return offset, borrow.slot
        return None

    def fill(self, buffers: list[memoryview], places: list[tuple[int, int] | None]) -> int:
        """Copy the lent buffers into their extents (those built in place are there
        already); the bytes lent."""
        area, lent, copied = self._area, 0, 0
        in_place = {borrow.slot for borrow in self._placed}
        for buffer, place in zip(buffers, places):
            if place is not None:
                if place[1] not in in_place:
                    offset = place[0]
                    if streaming.streams(buffer.nbytes):  # the receiver reads it, not us
                        streaming.copy_into(area, offset, buffer)
                    else:
                        area[offset : offset + buffer.nbytes] = buffer
                    copied += 1
                lent += buffer.nbytes
        figures = self._figures
        if figures is not None:
            figures[LENT_COPIED] += copied
            figures[LENT_IN_PLACE] += len(in_place)
        return lent

    def unreserve(self, places: list[tuple[int, int] | None]) -> None:
        """Take back reservations of a frame that was never published; a borrowed extent
        it would have published stays its producer's."""
        placed = {borrow.slot: borrow for borrow in self._placed}
        self._placed = []
        for place in places:
            if place is not None:
                borrow = placed.get(place[1])
                if borrow is not None:
                    borrow.sent = False
                    self._unsent[borrow.slot] = borrow
                else:
                    self._ctl[SLOT_BASE + place[1]] = FREE
        self.reap()

    def reap(self) -> None:
        """Return to the free list the extents of slots the receiver gave back, and of
        borrowed extents both the receiver (if it was sent them) and the producer are done
        with."""
        ctl, freed, borrows = self._ctl, [], self._borrows
        for slot in self._lent:
            borrow = borrows.get(slot) if borrows else None
            if borrow is None:
                if ctl[SLOT_BASE + slot] == FREE:
                    freed.append(slot)
            elif not borrow.alive and (not borrow.sent or ctl[SLOT_BASE + slot] == FREE):
                if not _forked_copy_pending(borrow):
                    freed.append(slot)
        for slot in freed:
            self._unsent.pop(slot, None)
            if borrows.pop(slot, None) is not None:
                ctl[SLOT_BASE + slot] = FREE  # one never sent is still LENT, by this end
            self._free.append(self._lent.pop(slot))
            self._slots.append(slot)

    def in_use(self) -> int:
        """Bytes of the area lent or in flight now (for tests and statistics)."""
        return sum(size for _, size in self._lent.values())

    def _reserve_one(self, nbytes: int) -> tuple[int, int] | None:
        size = -(-nbytes // PAGE) * PAGE
        # Extents given back are preferred to space never used: the area's pages are
        # committed (and first written, which costs a fault each) only as it must grow.
        offset = self._take_free(size) if self._slots else None
        if offset is None:
            self.reap()
            if not self._slots:
                return None
            offset = self._take_free(size)
        if offset is None:
            offset = self._take_top(size)
        if offset is None:
            self._coalesce()  # may also lower the top
            offset = self._take_free(size)
        if offset is None:
            offset = self._take_top(size)
        if offset is None:
            return None
        slot = self._slots.pop()
        self._lent[slot] = (offset, size)
        self._ctl[SLOT_BASE + slot] = LENT
        return offset, slot

    def _take_free(self, size: int) -> int | None:
        """The best-fitting free extent (split when larger than ``size``)."""
        free, best = self._free, -1
        for index, (_, extent) in enumerate(free):
            if extent >= size and (best < 0 or extent < free[best][1]):
                best = index
                if extent == size:
                    break
        if best < 0:
            return None
        offset, extent = free[best]
        if extent > size:
            free[best] = (offset + size, extent - size)
        else:
            free.pop(best)
        return offset

    def _take_top(self, size: int) -> int | None:
        """Space never used yet, at the top of what the area has used so far. An extent
        that would cross into the next lock chunk starts there instead; the space skipped
        goes to the free list (it lies within one chunk)."""
        if size > self._largest:
            return None  # no chunk holds it: it goes through the ring
        top = self._top
        while True:
            if top + size > self._capacity:
                return None
            end = self._chunk_end(top)
            if top + size <= end:
                break
            self._free.append((top, end - top))
            top = self._top = end
        self._top = top + size
        return top

    def _chunk_end(self, offset: int) -> int:
        ends = self._chunk_ends
        return ends[bisect.bisect_right(ends, offset)]

    def _coalesce(self) -> None:
        """Merge neighbouring free extents of one lock chunk (never across two)."""
        merged: list[tuple[int, int]] = []
        ends = set(self._chunk_ends)
        for offset, size in sorted(self._free):
            if merged and merged[-1][0] + merged[-1][1] == offset and offset not in ends:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((offset, size))
        while merged and merged[-1][0] + merged[-1][1] == self._top:
            self._top = merged.pop()[0]
        self._free = merged


class LentViews:
    """The receiver's side: a lent buffer as a view of the area, or a copy past the limit."""

    def __init__(self, region: SharedRegion, hold_limit: int, states: Any = None) -> None:
        # Where a slot's state is stored FREE: the ring's control page, or ``states``,
        # which a transport gives to send the slot back its own way (the pipe transport:
        # a message to the sender).
        self.ctl = region.ctl if states is None else states
        self.held = 0  # bytes of this channel's extents that users hold now
        # The root arrays are views of the region's mmap. Reached through the region,
        # which lets go of it when released: from then on only the roots hold the
        # mapping, and the last of them to die unmaps it.
        self._region = region
        self._start = region.lend_start
        self._hold_limit = hold_limit
        self._frombuffer: Any = None
        self._uint8: Any = None
        # Page-locking (the module's docstring): the locker this area is registered with,
        # in the process that registered it, and the mapping it holds while registered.
        self.locker: PageLocker | None = None
        self.locked_mapping: Any = None
        self._chunk_ends = chunk_ends_of(region) if region.lend_size else []
        self._locked_chunks: dict[int, int] = {}  # chunk index -> address registered
        self._locked_pid = 0  # the process that registered them
        self._lock_refused = False  # a registration was refused: lend the rest unlocked
        # Made for a loader that pins: here, or where its channel was made (``lay_out_area``).
        self._marked = _marked_now() or bool(region.lend_size and region.ctl[LOCK_CHUNKED])
        self._base = 0  # the area's address in this process, once known
        self.retired = False
        region.before_release.append(self._retire)
        _holding.receivers.add(self)

    def _lock(self, locker: PageLocker, offset: int) -> None:
        """Page-lock the chunk that holds ``offset``, in the process that lends from it."""
        chunk = bisect.bisect_right(self._chunk_ends, offset)
        if chunk in self._locked_chunks:
            return
        mapping = self._region.mapping
        if mapping is None or chunk >= len(self._chunk_ends):
            return
        if not self._base:
            probe = self._frombuffer(mapping, self._uint8, 1, self._start)
            self._base = probe.__array_interface__["data"][0]
            del probe
        start = self._chunk_ends[chunk - 1] if chunk else 0
        if not locker.register(self._base + start, self._chunk_ends[chunk] - start):
            self._lock_refused = True
            return
        self._locked_chunks[chunk] = self._base + start
        self.locker, self.locked_mapping = locker, mapping
        self._locked_pid = os.getpid()

    def locked_bytes(self) -> int:
        """Bytes of this area page-locked now (for tests and statistics)."""
        ends = self._chunk_ends
        return sum(ends[chunk] - (ends[chunk - 1] if chunk else 0) for chunk in self._locked_chunks)

    def unlock(self) -> None:
        """Unregister the area's chunks (before it is unmapped); only in the process that
        locked them."""
        chunks, self._locked_chunks = self._locked_chunks, {}
        locker, self.locker = self.locker, None
        self.locked_mapping = None
        if not chunks or locker is None or self._locked_pid != os.getpid():
            return
        for address in chunks.values():
            try:
                locker.unregister(address)
            except Exception:
                pass  # the process's device context is gone (interpreter exit): nothing to undo

    def _retire(self) -> None:
        """The channel lets go of the region: unlock now, or once the last lent buffer
        (dropped, its fence passed) is back."""
        self.retired = True
        if not self.held:
            self.unlock()

    def take(self, offset: int, slot: int, length: int) -> Any:
        """The buffer at ``offset``: an ndarray over shared memory, or a bytearray copy."""
        holding = _holding
        uint8 = self._uint8
        if uint8 is None:
            import numpy

            self._frombuffer = numpy.frombuffer
            uint8 = self._uint8 = numpy.dtype(numpy.uint8)
        if _locker is not None and not self._lock_refused and (self._marked or not _marked_only):
            self._lock(_locker, offset)
        if holding.awaiting:
            _reap_awaiting()
        with holding.lock:
            lend = self.held == 0 or self.held + length <= self._hold_limit
            if lend:
                self.held += length
                holding.lent += 1
                holding.held_buffers += 1
                holding.held_bytes += length
            else:
                holding.copied += 1
        start = self._start + offset
        mapping = self._region.mapping
        if not lend:
            try:
                with memoryview(mapping) as whole:
                    return self.copy_out(whole[start : start + length])
            finally:
                self.ctl[SLOT_BASE + slot] = FREE
        root = self._frombuffer(mapping, uint8, length, start)  # keywords cost it more
        ref = weakref.ref(root, _give_back)
        key = id(ref)
        holding.roots[key] = (ref, self, slot, length)
        if holding.forking:
            holding.pinned.add(key)  # another thread forks now: the child may inherit it
        elif holding.copying:
            _settle()
        return root

    def copy_out(self, source: memoryview) -> Any:
        """A writable copy of ``source``: page-locked where this area is, else a bytearray."""
        locker = self.locker
        if locker is None:
            return bytearray(source)
        out = locker.allocate(source.nbytes)
        with memoryview(out) as target:
            target[:] = source
        return out

    def count_copied(self) -> None:
        """A buffer large enough to lend came through the ring: the sender had no free
        extent or slot for it."""
        if _holding.awaiting:
            _reap_awaiting()
        with _holding.lock:
            _holding.copied += 1

    def discard(self, slot: int) -> None:
        """A lent buffer of a message that is dropped unread."""
        self.ctl[SLOT_BASE + slot] = FREE
