"""Open a page in headless Chromium through the DevTools protocol: console errors and uncaught
exceptions, the page's tables (first cell of every body row), and a full-page screenshot."""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from websockets.sync.client import connect

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
TABLES_JS = """JSON.stringify({
  tables: [...document.querySelectorAll('table')].map(t => ({
    id: t.closest('section, div, body').id || '', classes: t.className,
    heading: (() => {
      let e = t.previousElementSibling;
      while (e && !/^H[1-6]$/.test(e.tagName)) e = e.previousElementSibling;
      return e ? e.textContent : '';
    })(),
    rows: [...t.querySelectorAll('tbody tr')].map(r => r.cells[0].textContent.trim())})),
  scripts: document.querySelectorAll('script').length,
  text: document.body.innerText,
  svgs: document.querySelectorAll('svg').length,
  frontier: [...document.querySelectorAll('figure.frontier')].map(f => ({
    id: f.id, marks: [...f.querySelectorAll('g.mark')].map(g => g.dataset.build),
    names: [...f.querySelectorAll('text.pareto-name')].map(t => t.textContent),
    joined: f.querySelectorAll('polyline.pareto').length}))})"""


def browser_path() -> str | None:
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    return None


@dataclass
class PageCheck:
    errors: list[str]
    tables: list[dict]
    scripts: int
    text: str
    svgs: int
    frontier: list[dict]  # per frontier chart: id, marks (build ids), names (of the Pareto set), joined (lines)


class DevTools:
    def __init__(self, websocket):
        self.websocket = websocket
        self.next_id = 0
        self.events: list[dict] = []

    def send(self, method: str, params: dict | None = None, timeout: float = 60) -> dict:
        self.next_id += 1
        self.websocket.send(json.dumps({"id": self.next_id, "method": method, "params": params or {}}))
        deadline = time.time() + timeout
        while time.time() < deadline:
            message = json.loads(self.websocket.recv(timeout=deadline - time.time()))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)
        raise TimeoutError(method)

    def wait_for(self, event: str, timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        for message in self.events:
            if message.get("method") == event:
                return message
        while time.time() < deadline:
            message = json.loads(self.websocket.recv(timeout=deadline - time.time()))
            self.events.append(message)
            if message.get("method") == event:
                return message
        raise TimeoutError(event)

    def errors(self) -> list[str]:
        found = []
        for message in self.events:
            method, params = message.get("method"), message.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append("console." + params["type"] + ": " + " ".join(str(a.get("value", a.get("description")))
                                                                            for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                found.append("exception: " + json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                found.append("log: " + params["entry"].get("text", ""))
        return found


def check_page(html_file: Path, screenshot: Path, width: int = 1280, timeout: float = 90) -> PageCheck:
    browser = browser_path()
    if browser is None:
        raise FileNotFoundError(f"no headless browser found (looked for {', '.join(BROWSERS)})")
    # the browser's helper processes can still be writing to the profile as the folder is removed
    with tempfile.TemporaryDirectory(prefix="moeshrink-chromium-", ignore_cleanup_errors=True) as profile:
        process = subprocess.Popen([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                    "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                                    f"--user-data-dir={profile}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            port = _devtools_port(Path(profile) / "DevToolsActivePort", process, timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
                targets = json.loads(response.read())
            page = next(t for t in targets if t["type"] == "page")
            with connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=timeout) as websocket:
                tools = DevTools(websocket)
                for domain in ("Runtime", "Log", "Page"):
                    tools.send(f"{domain}.enable")
                tools.send("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False})
                tools.send("Page.navigate", {"url": Path(html_file).resolve().as_uri()})
                tools.wait_for("Page.loadEventFired", timeout)
                state = json.loads(tools.send("Runtime.evaluate", {"expression": TABLES_JS,
                                                                   "returnByValue": True})["result"]["value"])
                shot = tools.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                screenshot.write_bytes(base64.b64decode(shot["data"]))
                time.sleep(0.2)  # late console messages
                return PageCheck(errors=tools.errors(), tables=state["tables"], scripts=state["scripts"],
                                 text=state["text"], svgs=state["svgs"], frontier=state["frontier"])
        finally:
            _stop_group(process)


def _stop_group(process: subprocess.Popen) -> None:
    """Stop the browser and every helper it started (its own session, so its process group)."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
        deadline = time.time() + wait_s
        while time.time() < deadline:  # helpers outlive the main process briefly
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def _devtools_port(port_file: Path, process: subprocess.Popen, timeout: float) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the browser exited ({process.returncode}) before DevTools opened")
        if port_file.exists():
            lines = port_file.read_text().splitlines()
            if lines and lines[0].strip().isdigit():
                return int(lines[0])
        time.sleep(0.1)
    raise TimeoutError("DevTools did not open")


def require_browser() -> bool:
    """CI installs Chromium and sets MOESHRINK_REQUIRE_BROWSER=1: there a missing browser fails the test."""
    return os.environ.get("MOESHRINK_REQUIRE_BROWSER") == "1"
