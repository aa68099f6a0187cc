"""Streaming-store copies (``transport/streaming.py``): the bytes memcpy would write, at
every alignment and length, never past the destination; the extension built wherever a
compiler is; and the environment switch read as documented."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

from mprs_plus.transport import streaming

pytestmark = pytest.mark.timeout(60)

needs_extension = pytest.mark.skipif(
    streaming.copy_into is None, reason="the extension is not built here (see test_the_extension_is_built_where_a_compiler_is)"
)


def test_the_extension_is_built_where_a_compiler_is():
    """CI installs a C compiler: there, a missing extension is a broken build, not a skip."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if sys.platform != "linux" or shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine: copies take the ordinary path")
    assert streaming.copy_into is not None, "pip install -e . did not build mprs_plus.transport._streaming"
    if "MPRS_PLUS_STREAMING_STORES" not in os.environ:
        assert streaming.ENABLED == (platform.machine() in ("x86_64", "AMD64"))


@needs_extension
@pytest.mark.parametrize("offset", [0, 1, 7, 15, 16, 33, 63, 64])
def test_every_alignment_and_length_copies_exactly_the_source(offset):
    rng = np.random.default_rng(offset)
    for length in [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 1000, 4096 + 3, (256 << 10) + 5]:
        source = rng.integers(0, 256, length, dtype=np.uint8)
        out = np.full(offset + length + 80, 0xAB, dtype=np.uint8)
        streaming.copy_into(out, offset, source)
        assert np.array_equal(out[offset : offset + length], source)
        assert (out[:offset] == 0xAB).all() and (out[offset + length :] == 0xAB).all(), "wrote outside its bytes"
        again = np.full_like(out, 0xAB)
        streaming.copy_from_address(again, offset, source.__array_interface__["data"][0], length)
        assert np.array_equal(again, out)


@needs_extension
@pytest.mark.parametrize("offset, length", [(-1, 4), (0, 65), (60, 5), (65, 0), (0, -1)])
def test_bytes_that_would_not_fit_are_refused_and_nothing_is_written(offset, length):
    out = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="do not fit"):
        streaming.copy_from_address(out, offset, np.ones(max(length, 1), np.uint8).ctypes.data, length)
    if length >= 0:
        with pytest.raises(ValueError, match="do not fit"):
            streaming.copy_into(out, offset, np.ones(length, np.uint8))
    assert not out.any()


@needs_extension
def test_a_read_only_destination_is_refused():
    out = np.zeros(64, dtype=np.uint8)
    out.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        streaming.copy_into(out, 0, b"abc")


def _enabled_with(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPRS_PLUS_STREAMING_STORES=value)
    code = "from mprs_plus.transport import streaming; print(streaming.ENABLED)"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@needs_extension
def test_the_switch_turns_streaming_off_and_a_bad_value_says_what_it_takes():
    assert _enabled_with("0").stdout.strip() == "False"
    assert _enabled_with("1").stdout.strip() == str(platform.machine() in ("x86_64", "AMD64"))
    bad = _enabled_with("maybe")
    assert bad.returncode != 0 and "MPRS_PLUS_STREAMING_STORES must be 0 or 1, not 'maybe'" in bad.stderr


@needs_extension
@pytest.mark.parametrize("extra", [0, 1, 63])
def test_a_lent_buffer_is_written_with_streaming_stores_and_arrives_exactly(monkeypatch, extra):
    """A large buffer the sender copies into its lend area (not built there) goes through
    ``copy_into``: counted, and its bytes are the receiver's, whatever its length."""
    import multiprocessing

    import mprs_plus.runtime  # noqa: F401  the reducers the service registers
    from mprs_plus.transport import open_channel

    calls = []
    copy = streaming.copy_into

    def counted(out, offset, source):
        calls.append(len(source))
        return copy(out, offset, source)

    monkeypatch.setattr(streaming, "copy_into", counted)
    sender, receiver = open_channel(multiprocessing.get_context("fork"), capacity_items=8, capacity_bytes=4 << 20)
    try:
        item = np.random.default_rng(extra).integers(0, 256, (256 << 10) + extra, dtype=np.uint8)
        sender.send(item)
        received = receiver.recv(timeout=10)
        assert calls == [item.nbytes] and np.array_equal(received, item)
        del received
    finally:
        sender.close()
        receiver.close()
