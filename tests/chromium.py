"""Headless Chromium driven over the DevTools protocol (websocket-client), for the memory page's tests.

    with Chromium() as browser:          # pytest.skip (visibly) where no chromium is installed
        browser.navigate(url)
        browser.wait_for("window.pagoda && pagoda.renders > 0", 20)
        browser.evaluate("pagoda.tables('0').length")
        assert browser.errors() == []    # uncaught exceptions, console.error calls, error log entries

`make setup` installs Debian's `chromium` where apt is usable.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from common.redis_server import free_port

BINARIES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_binary() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class Chromium:
    def __init__(self, width: int = 1440, height: int = 1000, timeout: float = 30.0) -> None:
        binary = chromium_binary()
        if binary is None:
            pytest.skip("chromium is not installed (make setup installs Debian's `chromium` where apt is usable)")
        import websocket  # the test extra; imported here so a host without it skips above first

        self.port = free_port()
        self.profile = tempfile.mkdtemp(prefix="pagoda-chromium-")
        flags = ["--headless", f"--remote-debugging-port={self.port}", f"--user-data-dir={self.profile}",
                 "--remote-allow-origins=*", "--no-first-run", "--no-default-browser-check", "--disable-gpu",
                 "--disable-extensions", "--disable-background-networking", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:
            flags.insert(0, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.process = subprocess.Popen([binary, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.events: list[dict] = []
        self._next_id = 0
        try:
            page = self._page_target(timeout)
            self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout,
                                                  suppress_origin=True)
            for domain in ("Page", "Runtime", "Log"):
                self.send(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def _page_target(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"chromium exited with status {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list", timeout=2) as response:
                    pages = [t for t in json.load(response) if t["type"] == "page"]
                if pages:
                    return pages[0]
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"chromium's DevTools did not answer on port {self.port} in {timeout} s")
            time.sleep(0.1)

    # ------------------------------------------------------------------ the protocol
    def send(self, method: str, **params) -> dict:
        """One command's result; the events that arrive meanwhile are kept in `events`."""
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self._next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            if "method" in message:
                self.events.append(message)

    def navigate(self, url: str, timeout: float = 30.0) -> None:
        self.events.clear()
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout, "the page to load")

    def evaluate(self, expression: str):
        """The expression's value (JSON-able), awaited if a promise; RuntimeError if it throws."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(f"{expression!r} threw: {details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str = "") -> object:
        """The expression's first truthy value, polled; AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what or expression}; "
                                     f"page errors: {self.errors()}")
            time.sleep(0.1)

    def errors(self) -> list[str]:
        """Uncaught exceptions, console.error calls and error log entries (a failed load) so far,
        and what the page itself caught into window.pagoda.errors."""
        found = []
        for event in self.events:
            method, params = event["method"], event.get("params", {})
            if method == "Runtime.exceptionThrown":
                details = params["exceptionDetails"]
                found.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
            elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
                found.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                entry = params["entry"]
                if entry.get("url", "").endswith("/favicon.ico"):
                    continue  # asked by the browser for a page without an icon (a JSON answer); ours has one
                found.append(f"log: {entry['text']} {entry.get('url', '')}")
        try:
            found += [f"page: {e}" for e in self.evaluate("window.pagoda ? window.pagoda.errors : []") or []]
        except RuntimeError as exc:
            found.append(str(exc))
        return found

    def mouse_move(self, x: float, y: float) -> None:
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def screenshot(self, path: str | Path) -> int:
        """A PNG of the whole page at `path`; its size in bytes."""
        size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        shot = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1})
        data = base64.b64decode(shot["data"])
        Path(path).write_bytes(data)
        return len(data)

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
