"""``SharedList``: a dataset's records held once, in shared memory, read by every process.

Why
    A list of Python objects (dicts of a path, a label and a box) is copied into every
    forked worker page by page: reading an item changes its reference count, and the
    kernel copies the page that holds it. Under spawn and forkserver the whole list is
    pickled into each worker. A ``SharedList`` keeps the records pickled in one block of
    shared memory that no reference count touches; every process maps the same pages.

Layout of the block (written once, then only read)::

    [item 0's pickle][item 1's pickle] ... [item n-1's pickle][pad to 8][offsets: n+1 u64]

    item i = pickle.loads(block[offsets[i]:offsets[i+1]])

The memory
    The kinds the channels' lend areas use (``transport/_memory.py``): a memfd, else a
    POSIX shared-memory object or a temporary file, each unlinked as soon as it is opened.
    None has a name, so the kernel frees the block when the last descriptor or mapping of
    it is gone, in whichever process, even when the process that built it is killed:
    nothing is ever left in ``/dev/shm`` or the temporary directory.

How it crosses into another process (pickled as a handle, never as its bytes)
    fork         the child inherits the mapping and the descriptor.
    spawn,       the descriptor travels with the process's start arguments
    forkserver   (multiprocessing's descriptor passing), as a channel's region does.
    otherwise    (a Ray actor, a pickle sent over a channel): the handle names the pickling
                 process and its descriptor; the receiver opens ``/proc/<pid>/fd/<n>``,
                 which reaches the same memory while that process holds it. The handle
                 carries the machine's boot id and the block's inode, so that a receiver
                 on another machine, or one whose sender has let go, is told so instead of
                 mapping something else.
    another      a handle cannot reach memory on another machine: unpickling there raises
    machine      an error that says so. Build the list on that machine (each process
                 there then holds the bytes once, or all of them once through its own
                 ``SharedList``), or use columns in files that every node maps.
"""

from __future__ import annotations

import mmap
import os
import pickle
import weakref
from array import array
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing import reduction
from multiprocessing.context import get_spawning_popen
from typing import Any, NamedTuple, overload

from .transport._memory import anonymous_file

_WRITE_CHUNK = 1 << 22  # bytes gathered before one write into the block
_OFFSET = 8  # bytes per offset


def _boot_id() -> str:
    """This machine's boot id: two processes with the same one share a kernel, so a
    descriptor of one can be opened by the other through ``/proc``. "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


class _Handle(NamedTuple):
    """What a pickled ``SharedList`` carries instead of its bytes."""

    boot_id: str
    pid: int  # the pickling process, which holds ``fd``
    fd: int
    passed: Any  # a ``reduction.DupFd`` when the descriptor travels with a process's start, else None
    device: int  # the block's identity (st_dev, st_ino): a reused descriptor number is not taken for it
    inode: int
    size: int
    count: int
    data_end: int


class _Block:
    """One block mapped in this process: its descriptor, the read-only mapping, the offsets.

    The descriptor is closed and the pages unmapped when the last ``SharedList`` of this
    process that uses the block is gone; the kernel frees the block once no process holds it."""

    __slots__ = ("fd", "mapping", "data", "offsets", "count", "data_end", "size", "identity", "__weakref__")

    def __init__(self, fd: int, count: int, data_end: int) -> None:
        self.fd = fd
        info = os.fstat(fd)
        self.size = info.st_size
        self.identity = (info.st_dev, info.st_ino)
        self.count, self.data_end = count, data_end
        self.mapping = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ)
        whole = memoryview(self.mapping)
        self.data = whole[:data_end]
        offsets_at = _aligned(data_end)
        self.offsets = whole[offsets_at : offsets_at + (count + 1) * _OFFSET].cast("Q")
        whole.release()
        weakref.finalize(self, os.close, fd)  # last: until here a failure leaves the descriptor to the caller

    def handle(self) -> _Handle:
        passed = reduction.DupFd(self.fd) if get_spawning_popen() is not None else None
        return _Handle(
            _boot_id(), os.getpid(), self.fd, passed, *self.identity, self.size, self.count, self.data_end
        )


# The blocks mapped in this process, by identity: a view and its list, or a list that
# arrives twice, share one mapping.
_BLOCKS: weakref.WeakValueDictionary[tuple[int, int], _Block] = weakref.WeakValueDictionary()


def _aligned(n: int) -> int:
    return -(-n // _OFFSET) * _OFFSET


def _build(items: Iterable[Any]) -> _Block:
    """Pickle ``items`` one after the other into a fresh block, then their offsets."""
    fd, _kind = anonymous_file("mprs_plus SharedList", 0)
    try:
        offsets = array("Q", [0])
        pending: list[bytes] = []
        pending_bytes = written = 0
        dumps, protocol = pickle.dumps, pickle.HIGHEST_PROTOCOL
        out = _Writer(fd)
        for item in items:
            data = dumps(item, protocol)
            written += len(data)
            offsets.append(written)
            pending.append(data)
            pending_bytes += len(data)
            if pending_bytes >= _WRITE_CHUNK:
                out.write(b"".join(pending))
                pending.clear()
                pending_bytes = 0
        pending.append(bytes(_aligned(written) - written))
        pending.append(offsets.tobytes())
        out.write(b"".join(pending))
        out.finish()
        block = _Block(fd, len(offsets) - 1, written)
    except BaseException:
        os.close(fd)
        raise
    _BLOCKS[block.identity] = block
    return block


class _Writer:
    """Appends to the block's descriptor. ``write`` works on a memfd, a file and Linux's
    POSIX shared memory; where a shared-memory object takes no ``write`` (macOS), the bytes
    are gathered and copied in once through a mapping, at the end."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.gathered: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if self.gathered is not None:
            self.gathered.append(data)
            return
        view = memoryview(data)
        while view:
            try:
                done = os.write(self.fd, view)
            except OSError:
                if os.lseek(self.fd, 0, os.SEEK_CUR):
                    raise  # it took some bytes already: a real failure (out of memory, say)
                self.gathered = [bytes(view)]
                return
            view = view[done:]

    def finish(self) -> None:
        if self.gathered is None:
            return
        total = sum(len(part) for part in self.gathered)
        os.ftruncate(self.fd, total)
        with mmap.mmap(self.fd, total) as mapping:
            at = 0
            for part in self.gathered:
                mapping[at : at + len(part)] = part
                at += len(part)
        self.gathered = None


def _open(handle: _Handle) -> _Block:
    """Map the block a handle names, in the process that unpickles it."""
    identity = (handle.device, handle.inode)
    known = _BLOCKS.get(identity)
    if handle.passed is not None:
        fd = handle.passed.detach()  # ours now: closed below if the block is mapped here already
        if known is not None:
            os.close(fd)
            return known
    elif known is not None:
        return known
    else:
        fd = _reach(handle)
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != identity:
            raise _unreachable(handle, "its holder no longer holds it")
        block = _Block(fd, handle.count, handle.data_end)
    except BaseException:
        os.close(fd)
        raise
    _BLOCKS[identity] = block
    return block


def _reach(handle: _Handle) -> int:
    """Open the block through the holder's descriptor (``/proc/<pid>/fd/<n>``)."""
    if not handle.boot_id or handle.boot_id != _boot_id():
        raise _unreachable(handle, "it was pickled on another machine (or where /proc is not available)")
    try:
        return os.open(f"/proc/{handle.pid}/fd/{handle.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise _unreachable(handle, f"its holder, process {handle.pid}, cannot be reached ({exc.strerror})") from None


def _unreachable(handle: _Handle, why: str) -> RuntimeError:
    return RuntimeError(
        f"a SharedList of {handle.count:,} items cannot be mapped here: {why}. A SharedList pickles as a "
        "handle to shared memory on its machine, readable while a process that pickled it still holds it; "
        "build the SharedList on this machine, or keep the process that sent it alive until it is received."
    )


def _from_handle(handle: _Handle, start: int, stop: int, step: int) -> SharedList:
    shared = SharedList.__new__(SharedList)
    shared._block = _open(handle)
    shared._indices = range(start, stop, step)
    return shared


class SharedList(Sequence):
    """A read-only list whose items live once, pickled, in shared memory that every process
    maps: a dataset of Python objects that forked, spawned, forkserver workers (torch's
    ``DataLoader``, ``mprs_plus.DataLoader``, the reading service) and same-machine Ray
    actors read without a copy per worker.

    ``SharedList(iterable)`` pickles each item once (protocol 5) into one block of shared
    memory, with their offsets beside them. Then:

    - ``len(s)``, ``s[i]`` (negative ``i`` counts from the end; out of range raises
      ``IndexError``), iteration, ``in``, ``index()``, ``count()``;
    - **every access returns a fresh copy**, unpickled from the block: changing it changes
      nothing stored, and the next ``s[i]`` is the item as it was built;
    - ``s[a:b:c]`` is a ``SharedList`` over the same block (no copy; ``list(s[a:b])`` copies
      the items out), so a split of a dataset shares its memory too;
    - pickling it (a worker's start, a Ray actor's arguments) carries a handle of a few
      hundred bytes, whatever the data's size; another process maps the same block. On
      another machine it cannot: unpickling there raises an error that says so.

    The block is freed when the last ``SharedList`` over it, in any process, is gone;
    nothing is left in ``/dev/shm`` or the temporary directory, even after SIGKILL.
    """

    __slots__ = ("_block", "_indices")

    def __init__(self, iterable: Iterable[Any] = ()) -> None:
        self._block = _build(iterable)
        self._indices = range(self._block.count)

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> SharedList: ...

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            view = SharedList.__new__(SharedList)
            view._block, view._indices = self._block, self._indices[index]
            return view
        try:
            i = self._indices[index]
        except IndexError:
            raise IndexError(f"SharedList index {index} out of range for {len(self._indices)} items") from None
        block = self._block
        offsets = block.offsets
        return pickle.loads(block.data[offsets[i] : offsets[i + 1]])

    def __iter__(self) -> Iterator[Any]:
        block, loads = self._block, pickle.loads
        data, offsets = block.data, block.offsets
        for i in self._indices:
            yield loads(data[offsets[i] : offsets[i + 1]])

    def __reversed__(self) -> Iterator[Any]:
        return iter(self[::-1])

    @property
    def nbytes(self) -> int:
        """Bytes of the whole shared block (the items' pickles and their offsets); a view
        shares its list's block."""
        return self._block.size

    def __repr__(self) -> str:
        return f"SharedList({len(self):,} items, {self._block.size / 2**20:,.1f} MiB shared)"

    def __reduce__(self) -> tuple[Any, ...]:
        indices = self._indices
        return _from_handle, (self._block.handle(), indices.start, indices.stop, indices.step)

    def __copy__(self) -> SharedList:
        return self  # immutable: a copy would be the same items

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedList:
        return self


__all__ = ["SharedList"]
