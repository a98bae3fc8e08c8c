"""A headless Chromium driven over the DevTools protocol, for the page tests (tests/test_view.py).

Chromium runs with --proxy-server pointing at a closed port, so a page that tried to reach the
network could not, and every request it makes is recorded from the protocol's Network events;
console calls, uncaught exceptions and the browser's own log entries are recorded as well.
Needs the `chromium` executable (Debian's package) and the `websocket-client` package.
"""
import base64
import json
import os
import shutil
import subprocess
import tempfile
import time


def find_chromium():
    """The path of a Chromium executable, or None."""
    for name in (os.environ.get("PYALLOC_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


class Page:
    """One tab: load(url) records what happened; evaluate(js) returns a JSON-able value."""

    def __init__(self, browser, session):
        self.browser = browser
        self.session = session
        self.console = []        # (type, text) of console.* calls
        self.exceptions = []     # uncaught exception texts
        self.log = []            # (level, text) of the browser's log entries (failed loads, ...)
        self.requests = []       # URLs requested

    def send(self, method, **params):
        return self.browser.send(method, params, self.session)

    def _record(self, message):
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append((params.get("type"), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.exceptions.append(details.get("exception", {}).get("description") or details.get("text"))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.log.append((entry.get("level"), entry.get("text")))
        elif method == "Network.requestWillBeSent":
            self.requests.append(params.get("request", {}).get("url"))

    def load(self, url, timeout=60, wait_rendered=True, settle=0.0):
        """Navigate, wait for the load event and, with `wait_rendered`, for the page's script to
        mark the body data-rendered="1" (or to throw); then go on recording events for `settle`
        seconds, for the tests that look for late console messages or requests (the rest would
        wait for nothing: the renderer's events up to data-rendered come before the reply that
        reads it)."""
        self.console.clear(), self.exceptions.clear(), self.log.clear(), self.requests.clear()
        since = len(self.browser._events)      # the load event may come before navigate's reply
        self.send("Page.navigate", url=url)
        self.browser.wait_event("Page.loadEventFired", self.session, timeout, since)
        deadline = time.monotonic() + timeout
        while wait_rendered and time.monotonic() < deadline:
            if self.evaluate("document.body && document.body.getAttribute('data-rendered')") == "1":
                break
            if self.exceptions:
                break
            time.sleep(0.05)
        self.browser.drain(settle)
        return self

    def evaluate(self, expression):
        out = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression!r} raised: {out['exceptionDetails'].get('text')}")
        return out["result"].get("value")

    def hover(self, selector, fx=0.5, fy=0.5):
        """Move the mouse over the first element matching `selector`, at fractions (fx, fy) of
        its box, after scrolling it into view."""
        box = self.evaluate(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            e.scrollIntoView({{block: "center"}}); const r = e.getBoundingClientRect();
            return [r.left, r.top, r.width, r.height]; }})()""")
        x, y = box[0] + box[2] * fx, box[1] + box[3] * fy
        self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        self.browser.drain(0.1)

    def screenshot(self, path, width=1400):
        """A PNG of the whole page, `width` CSS pixels wide."""
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=900, deviceScaleFactor=1, mobile=False)
        height = self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                  mobile=False)
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))


class Chromium:
    """A headless Chromium process and one DevTools connection to it; use as a context manager."""

    def __init__(self, executable, timeout=60):
        import websocket   # websocket-client: a test-only dependency

        self.profile = tempfile.mkdtemp(prefix="pyalloc-chromium-")
        self.log_path = os.path.join(self.profile, "stderr.log")
        args = [executable, "--headless", "--disable-gpu", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps", "--proxy-server=127.0.0.1:9",
                "--proxy-bypass-list=<-loopback>", "about:blank"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")     # Chromium refuses to run as root with its sandbox
        self.pages = {}
        self.ws = None
        self._stderr = open(self.log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._stderr)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout
        while True:
            if os.path.exists(port_file):
                lines = open(port_file).read().split()
                if len(lines) >= 2:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start; its log: {self.log_path}")
            time.sleep(0.05)
        self.ws = websocket.create_connection(f"ws://127.0.0.1:{lines[0]}{lines[1]}", timeout=timeout,
                                              suppress_origin=True)
        self._id = 0
        self._events = []

    def send(self, method, params=None, session=None, timeout=60):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self._receive(deadline - time.monotonic())
            if reply is not None and reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise TimeoutError(method)

    def _receive(self, timeout):
        import websocket

        self.ws.settimeout(max(0.01, timeout))
        try:
            message = json.loads(self.ws.recv())
        except websocket.WebSocketTimeoutException:
            return None
        if "method" in message:
            self._events.append(message)
            page = self.pages.get(message.get("sessionId"))
            if page is not None:
                page._record(message)
        return message

    def wait_event(self, method, session, timeout, since):
        """The first event `method` of `session` received after the first `since` events."""
        deadline = time.monotonic() + timeout
        seen = since
        while time.monotonic() < deadline:
            for m in self._events[seen:]:
                if m.get("method") == method and m.get("sessionId") == session:
                    return m
            seen = len(self._events)
            self._receive(deadline - time.monotonic())
        raise TimeoutError(method)

    def drain(self, seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._receive(deadline - time.monotonic())

    def new_page(self):
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, session)
        page.target = target
        self.pages[session] = page
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.send(domain + ".enable")
        return page

    def close_page(self, page):
        self.send("Target.closeTarget", {"targetId": page.target})
        self.pages.pop(page.session, None)

    def close(self):
        ws = getattr(self, "ws", None)
        if ws is not None:
            try:
                self.send("Browser.close", timeout=5)
            except Exception:  # noqa: BLE001 -- closing anyway
                pass
            ws.close()
            self.ws = None
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
