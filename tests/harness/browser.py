"""Open a local page in headless Chromium (Debian's `chromium`) and report what a person would see.

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: commands on
fd 3, replies on fd 4, NUL-terminated JSON), so no websocket client or driver package is needed.
`inspect(page)` returns the console errors and uncaught exceptions, every request the page made
that left the file (http, https, ...), the images and whether each decoded, the page's own
`data-ready` mark, the leaderboard's setting rows, and a screenshot.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser")
LOCAL_SCHEMES = ("file:", "data:", "about:", "blob:", "chrome-error:")

CHECK_JS = """JSON.stringify({
  ready: document.body && document.body.getAttribute('data-ready'),
  text: document.body ? document.body.innerText.length : 0,
  images: Array.from(document.images).map(function(i){
    return {alt: i.alt, complete: i.complete, width: i.naturalWidth, height: i.naturalHeight};}),
  boardRows: document.querySelectorAll('table.board tbody tr.setting').length
})"""


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name) if not name.startswith("/") else (name if os.access(name, os.X_OK)
                                                                    else None)
        if path:
            return path
    return None


class _Pipe:
    def __init__(self, write_fd: int, read_fd: int):
        self.write_fd, self.read_fd, self.buffer, self.next_id = write_fd, read_fd, b"", 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float = 20.0) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout_s: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout_s
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._read(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("chromium did not answer in time")
            try:
                chunk = os.read(self.read_fd, 1 << 20)
            except BlockingIOError:
                time.sleep(0.01)
                continue
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)


def inspect(page: Path, width: int = 1400, height: int = 900, settle_s: float = 0.3,
            scripts: dict[str, str] | None = None, before_shot: str = "") -> dict:
    """Load `page` (a local file) and return what it showed; `scripts` {name: JavaScript} are
    run after the checks, their values under state["scripts"]; `before_shot` (JavaScript, e.g.
    a scroll) runs just before the screenshot. RuntimeError if chromium fails."""
    chromium = find_chromium()
    if chromium is None:
        raise FileNotFoundError("chromium is not installed")
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    high_r = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 100)  # out of the way of 3 and 4
    high_w = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 100)

    def child_fds():
        os.dup2(high_r, 3)
        os.dup2(high_w, 4)

    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen(
            [chromium, "--headless=new", "--remote-debugging-pipe", "--no-sandbox",
             "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking",
             "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=child_fds)
        for fd in (to_child_r, from_child_w, high_r, high_w):
            os.close(fd)
        os.set_blocking(from_child_r, False)
        pipe = _Pipe(to_child_w, from_child_r)
        try:
            return _visit(pipe, page, width, height, settle_s, scripts or {}, before_shot)
        finally:
            try:
                pipe.send("Browser.close", timeout_s=5)
            except (RuntimeError, TimeoutError, OSError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            os.close(to_child_w)
            os.close(from_child_r)


def _visit(pipe: _Pipe, page: Path, width: int, height: int, settle_s: float,
           scripts: dict[str, str], before_shot: str = "") -> dict:
    targets = pipe.send("Target.getTargets")["targetInfos"]
    target = next(t["targetId"] for t in targets if t["type"] == "page")
    session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime", "Log", "Network", "Page"):
        pipe.send(f"{domain}.enable", session=session)
    pipe.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                     "deviceScaleFactor": 1, "mobile": False},
              session=session)
    pipe.events.clear()
    url = Path(page).resolve().as_uri()
    pipe.send("Page.navigate", {"url": url}, session=session)
    deadline = time.monotonic() + 20
    while True:  # a load event may still be about:blank's: wait for this page, fully loaded
        where = pipe.send("Runtime.evaluate", {"expression": "location.href + ' ' + "
                                                             "document.readyState",
                                               "returnByValue": True},
                          session=session)["result"].get("value")
        if where == f"{url} complete":
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{page} did not finish loading ({where})")
        time.sleep(0.05)
    time.sleep(settle_s)  # late console messages
    state = json.loads(pipe.send("Runtime.evaluate", {"expression": CHECK_JS,
                                                      "returnByValue": True},
                                 session=session)["result"]["value"])
    if before_shot:
        pipe.send("Runtime.evaluate", {"expression": before_shot}, session=session)
        time.sleep(0.1)
    shot = pipe.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
    state["screenshot_png"] = base64.b64decode(shot)
    state["scripts"] = {name: pipe.send("Runtime.evaluate", {"expression": js,
                                                             "returnByValue": True},
                                        session=session)["result"].get("value")
                        for name, js in scripts.items()}
    state["errors"], state["requests"] = _problems(pipe.events)
    return state


def _problems(events: list[dict]) -> tuple[list[str], list[str]]:
    errors, requests = [], []
    for e in events:
        method, params = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append("console: " + " ".join(str(a.get("value", a.get("description", "")))
                                                 for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            errors.append("exception: " + str(details.get("exception", {}).get(
                "description", details.get("text"))))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            errors.append("log: " + params["entry"].get("text", ""))
        elif method == "Network.requestWillBeSent":
            url = params.get("request", {}).get("url", "")
            if not url.startswith(LOCAL_SCHEMES):
                requests.append(url)
    return errors, requests
