"""A headless Chromium driven over its DevTools protocol, for the docs' layout test.

Chromium speaks the protocol over a pair of pipes when started with
``--remote-debugging-pipe``: it reads commands from its file descriptor 3 and writes
replies and events to its descriptor 4, each message one JSON object followed by a NUL
byte. That needs no websocket client and no port, so nothing else on the machine can
reach the browser. One page (a target attached in flattened mode) is enough here:
navigate, wait for the load event, evaluate a script, take a screenshot.

Every wait is bounded: a reply that does not come within the deadline raises
``TimeoutError`` and the browser is killed on ``close()``.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path


def find_chromium() -> str | None:
    """The Chromium (or Chrome) program on the PATH, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _above_9(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless browser with one page; use as a context manager."""

    def __init__(self, program: str, profile: Path, timeout: float = 30.0):
        self.timeout = timeout
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()
        # Above 9, so that moving one to 3 or 4 cannot overwrite the other first.
        to_browser_read, from_browser_write = (_above_9(fd) for fd in (to_browser_read, from_browser_write))
        # The browser must find the pipes at descriptors 3 and 4: bash moves them there
        # (dash, which may be sh, reads only one-digit descriptors). Scrollbars are kept, so
        # that a page measured at 1280 px has a desktop browser's room beside them.
        command = [
            "bash", "-c", f'exec "$@" 3<&{to_browser_read}- 4>&{from_browser_write}-', "bash",
            program, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
            "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--disable-background-networking", "--mute-audio",
            f"--user-data-dir={profile}", "about:blank",
        ]
        self._process = subprocess.Popen(
            command, pass_fds=(to_browser_read, from_browser_write),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_read)
        os.close(from_browser_write)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict] = []
        self._session: str | None = None
        try:
            target = self.send("Target.createTarget", url="about:blank", browser=True)["targetId"]
            self._session = self.send("Target.attachToTarget", targetId=target, flatten=True, browser=True)["sessionId"]
            self.send("Page.enable")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Ask the browser to exit, then kill it if it has not within a few seconds."""
        if self._process.poll() is None:
            try:
                self._write({"id": -1, "method": "Browser.close"})
            except OSError:
                pass
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=5)
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        self._to_browser = self._from_browser = -1

    # The protocol.

    def _write(self, message: dict) -> None:
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the browser did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], min(left, 1.0))
            if not ready:
                if self._process.poll() is not None:
                    raise RuntimeError(f"the browser exited with code {self._process.returncode}")
                continue
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser closed its end of the protocol pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, browser: bool = False, **params) -> dict:
        """Send a command (to the page unless ``browser``) and return its result."""
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if not browser:
            message["sessionId"] = self._session
        self._write(message)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def _wait_for_event(self, method: str) -> dict:
        deadline = time.monotonic() + self.timeout
        while True:
            for index, event in enumerate(self._events):
                if event["method"] == method:
                    return self._events.pop(index)
            reply = self._read(deadline)
            if "method" in reply:
                self._events.append(reply)

    # What the test uses.

    def open(self, url: str, width: int, height: int = 800) -> None:
        """Show ``url`` in a window ``width`` CSS pixels wide and wait until it has loaded."""
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=width < 600)
        self._events.clear()
        self.send("Page.navigate", url=url)
        self._wait_for_event("Page.loadEventFired")

    def evaluate(self, expression: str):
        """The value of a JavaScript expression on the page (JSON-serialisable)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"the page's script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page, as tall as it is."""
        size = self.send("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        data = self.send("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
