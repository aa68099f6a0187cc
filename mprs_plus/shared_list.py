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
    another      a handle cannot reach memory on another machine. Where a pickle may be read
    machine      on one (in a Ray cluster of several nodes), it carries the block's bytes
                 too, out of band (Ray's pickler keeps them in its object store): the bytes
                 travel once to each process there, which reads its copy; a process of the
                 same machine still maps the shared block. Elsewhere, unpickling on another
                 machine raises an error that says so.
"""

from __future__ import annotations

import mmap
import os
import pickle
import sys
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
    global _BOOT_ID
    if _BOOT_ID is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                _BOOT_ID = f.read().strip()
        except OSError:
            _BOOT_ID = ""
    return _BOOT_ID


_BOOT_ID: str | None = None


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
    """One block in this process: its descriptor and read-only mapping (or, on another
    machine, a copy of its bytes: ``fd`` None), the items' bytes and their offsets.

    The descriptor is closed and the pages unmapped when the last ``SharedList`` of this
    process that uses the block is gone; the kernel frees the block once no process holds it."""

    __slots__ = ("fd", "memory", "data", "offsets", "count", "data_end", "size", "identity", "__weakref__")

    def __init__(self, fd: int | None, count: int, data_end: int, copy: Any = None, identity: Any = None) -> None:
        self.fd = fd
        if fd is not None:
            info = os.fstat(fd)
            self.identity = (_boot_id(), info.st_dev, info.st_ino)
            self.memory = memoryview(mmap.mmap(fd, info.st_size, mmap.MAP_SHARED, mmap.PROT_READ))
        else:
            self.identity = identity
            self.memory = memoryview(copy).cast("B")
        self.size = len(self.memory)
        self.count, self.data_end = count, data_end
        self.data = self.memory[:data_end]
        offsets_at = _aligned(data_end)
        self.offsets = self.memory[offsets_at : offsets_at + (count + 1) * _OFFSET].cast("Q")
        if fd is not None:
            weakref.finalize(self, os.close, fd)  # last: until here a failure leaves the descriptor to the caller

    def handle(self) -> _Handle:
        fd = self.fd if self.fd is not None else -1
        passed = reduction.DupFd(fd) if fd >= 0 and get_spawning_popen() is not None else None
        boot_id, device, inode = self.identity
        return _Handle(boot_id, os.getpid(), fd, passed, device, inode, self.size, self.count, self.data_end)


# The blocks mapped in this process, by identity: a view and its list, or a list that
# arrives twice, share one mapping.
_BLOCKS: weakref.WeakValueDictionary[tuple[str, int, int], _Block] = weakref.WeakValueDictionary()


def _aligned(n: int) -> int:
    return -(-n // _OFFSET) * _OFFSET


def _build(items: Iterable[Any]) -> _Block:
    """Pickle ``items`` one after the other into a fresh block, then their offsets."""
    out = _Writer()
    try:
        offsets = array("Q", [0])
        pending: list[bytes] = []
        pending_bytes = written = 0
        dumps, protocol = pickle.dumps, pickle.HIGHEST_PROTOCOL
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
        block = _Block(out.fd, len(offsets) - 1, written)
    except BaseException:
        out.close()
        raise
    _BLOCKS[block.identity] = block
    return block


class _Writer:
    """Appends to a fresh block. ``write`` works on a memfd, a file and Linux's POSIX
    shared memory; where a shared-memory object takes no ``write`` and is sized once, at
    its creation (macOS), the bytes are gathered, and copied at the end into a block made
    to their size."""

    _NAME = "mprs_plus SharedList"

    def __init__(self) -> None:
        self.fd: int | None = anonymous_file(self._NAME, 0)[0]
        self.gathered: list[bytes] | None = None

    def _write(self, view: memoryview) -> int:
        return os.write(self.fd, view)

    def write(self, data: bytes) -> None:
        if self.gathered is not None:
            self.gathered.append(data)
            return
        view = memoryview(data)
        while view:
            try:
                done = self._write(view)
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
        fd, _kind = anonymous_file(self._NAME, total)
        self.close()
        self.fd = fd
        with mmap.mmap(fd, total) as mapping:
            at = 0
            for part in self.gathered:
                mapping[at : at + len(part)] = part
                at += len(part)
        self.gathered = None

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


def _open(handle: _Handle) -> _Block:
    """Map the block a handle names, in the process that unpickles it."""
    identity = (handle.boot_id, handle.device, handle.inode)
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
        if (handle.boot_id, info.st_dev, info.st_ino) != identity:
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
    if handle.fd < 0:
        raise _unreachable(handle, f"process {handle.pid} that pickled it holds a copy, not the shared block")
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


def _from_handle(handle: _Handle, start: int, stop: int, step: int, payload: Any = None) -> SharedList:
    try:
        block = _open(handle)
    except RuntimeError:
        if payload is None:
            raise
        block = _copy_of(handle, payload)  # another machine: the bytes came with the pickle
    shared = SharedList.__new__(SharedList)
    shared._block = block
    shared._indices = range(start, stop, step)
    return shared


def _copy_of(handle: _Handle, payload: Any) -> _Block:
    """The block's bytes that travelled with the pickle, as this process's block (one per
    block per process: a list and its views, or a list that arrives twice, share it)."""
    identity = (handle.boot_id, handle.device, handle.inode)
    known = _BLOCKS.get(identity)
    if known is not None:
        return known
    block = _Block(None, handle.count, handle.data_end, copy=payload, identity=identity)
    _BLOCKS[identity] = block
    return block


def _other_machines_may_read() -> bool:
    """Whether a pickle made now may be read on another machine: in a Ray cluster of
    several nodes (Ray moves an actor's arguments to its node)."""
    ray = sys.modules.get("ray")
    try:
        return bool(ray is not None and ray.is_initialized() and sum(1 for node in ray.nodes() if node["Alive"]) > 1)
    except Exception:  # a Ray that cannot say: the handle alone, as on one machine
        return False


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
      hundred bytes, whatever the data's size; another process of the machine maps the
      same block. Across machines (a Ray cluster of several nodes) the bytes travel too,
      once per receiving process, which reads its own copy.

    The block is freed when the last ``SharedList`` over it, in any process, is gone;
    nothing is left in ``/dev/shm`` or the temporary directory, even after SIGKILL.

    Args:
        iterable: the items, each picklable; read once, in this process.
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

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        block, indices = self._block, self._indices
        handle = block.handle()
        payload: Any = None
        if handle.passed is None and (block.fd is None or _other_machines_may_read()):
            # The bytes too: out of band where the pickler takes buffers so (Ray's does).
            payload = pickle.PickleBuffer(block.memory) if protocol >= 5 else bytes(block.memory)
        return _from_handle, (handle, indices.start, indices.stop, indices.step, payload)

    def __copy__(self) -> SharedList:
        return self  # immutable: a copy would be the same items

    def __deepcopy__(self, memo: dict[int, Any]) -> SharedList:
        return self


__all__ = ["SharedList"]
