"""The graph page in a real browser (issue 32): Debian's headless Chromium, driven over the DevTools
protocol on a pipe (no extra package), loads the file and records every request the page makes: only
the file itself and data: URLs, nothing from a network; plotly draws it (SVG, a non-blank
screenshot); the page's live figure and its embedded numbers hold the Python object's values; the
answer-token menu switches the view. A control page with one remote image shows the request check
can fail. ``make setup`` installs chromium where it can (root, apt-get); elsewhere this file skips."""
import base64
import io
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

import iglens_graph as igg
import iglens_view as igv
from test_view import LENGTH, PROMPT, ids_of, model_of, share_in

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=1450,950"]


def _require_chromium():
    if CHROMIUM:
        return
    if os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail("chromium is missing although this machine can install it (root, apt-get): run `make setup`")
    pytest.skip("Debian's chromium is not installed and cannot be here (not root or no apt-get); "
                "`apt-get install chromium` as root, or `make setup`, installs it")


class Browser:
    """Chromium with the DevTools protocol on fds 3 (commands in) and 4 (replies and events out)."""

    def __init__(self, profile):
        ours_in, theirs_out = os.pipe()
        theirs_in, ours_out = os.pipe()

        def child():  # dup first: a pipe end may already sit on fd 3 or 4
            read_end, write_end = os.dup(theirs_in), os.dup(theirs_out)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)
        self.process = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                        close_fds=False, preexec_fn=child, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        os.close(theirs_in)
        os.close(theirs_out)
        self.reader, self.writer = ours_in, ours_out
        self.count, self.events, self.buffer = 0, [], b""

    def _message(self):
        while b"\0" not in self.buffer:
            chunk = os.read(self.reader, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method, params=None, session=None):
        self.count += 1
        message = {"id": self.count, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.writer, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._message()
            if reply.get("id") == self.count:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait(self, method, session):
        for k, event in enumerate(self.events):
            if event.get("method") == method and event.get("sessionId") == session:
                return self.events.pop(k)
        while True:
            event = self._message()
            if event.get("method") == method and event.get("sessionId") == session:
                return event
            self.events.append(event)

    def open(self, url):
        """A new tab on ``url``, loaded; returns its session and the list its requests go to."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Network.enable", session=session)
        self.send("Page.enable", session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait("Page.loadEventFired", session)
        return session

    def requests(self, session):
        return [event["params"]["request"]["url"] for event in self.events
                if event.get("method") == "Network.requestWillBeSent" and event.get("sessionId") == session]

    def evaluate(self, expression, session):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=session)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"]["value"]

    def close(self):
        try:
            self.send("Browser.close")
            self.process.wait(timeout=20)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        finally:
            os.close(self.reader)
            os.close(self.writer)


def _offline(urls):
    return [url for url in urls if not url.startswith(("file:", "data:", "blob:", "about:"))]


def test_page_in_chromium(tmp_path):
    _require_chromium()
    model, ids = model_of("llama", seed=3), ids_of(3)
    texts = [f"w{i}" for i in ids[0].tolist()]
    views = [igv.graph_view(model, ids, PROMPT, texts, token=token, fraction=0.5, min_share=0.02, steps=4)
             for token in (1, 4)]
    graphs = [igg.attribution_graph(model, ids, PROMPT, token=token, steps=4) for token in (1, 4)]
    page = igv.to_graph_html(views, tmp_path / "graph.html")
    control = tmp_path / "control.html"
    control.write_text('<html><body><img src="http://example.invalid/a.png"></body></html>', encoding="utf-8")
    browser = Browser(tmp_path / "profile")
    try:
        session = browser.open(page.as_uri())
        drawn = browser.evaluate("""(() => {
            const gd = document.getElementById('iglens-graph');
            const nodes = gd.data.filter(trace => trace.name === 'nodes' && trace.visible === true);
            return {svg: gd.querySelectorAll('.main-svg').length,
                    points: gd.querySelectorAll('.scatterlayer .point').length,
                    heatmaps: gd.querySelectorAll('.heatmaplayer image').length,
                    title: gd.querySelector('.gtitle').textContent,
                    shares: nodes.map(trace => trace.customdata.map(cell => cell[4])),
                    embedded: JSON.parse(document.getElementById('iglens-graph-data').textContent)};
        })()""", session)
        shot = base64.b64decode(browser.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"])
        (tmp_path / "shot.png").write_bytes(shot)
        switched = browser.evaluate("""(() => {
            const gd = document.getElementById('iglens-graph');
            const button = gd.layout.updatemenus[0].buttons[1];
            return Plotly.update(gd, button.args[0], button.args[1]).then(() => ({
                title: gd.querySelector('.gtitle').textContent,
                shares: gd.data.filter(trace => trace.name === 'nodes' && trace.visible === true)
                               .map(trace => trace.customdata.map(cell => cell[4]))}));
        })()""", session)
        requests = browser.requests(session)
        control_session = browser.open(control.as_uri())
        control_requests = browser.requests(control_session)
    finally:
        browser.close()
    assert requests[0] == page.as_uri() and _offline(requests) == [], requests
    assert _offline(control_requests) == ["http://example.invalid/a.png"]  # the check sees a remote request
    assert drawn["svg"] >= 1 and drawn["heatmaps"] >= 1 and drawn["points"] >= len(views[0].nodes)
    import matplotlib.image
    pixels = matplotlib.image.imread(io.BytesIO(shot))[..., :3]
    assert min(pixels.shape[:2]) > 500 and pixels.std() > 0.05
    assert len(np.unique((pixels * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50  # colours drawn
    for k, (shares, graph) in enumerate(zip((drawn["shares"], switched["shares"]), graphs)):
        entry = drawn["embedded"]["views"][k]
        want = [share_in(graph, igg.Node(n["kind"], n["block"], n["position"], n["index"], 0.0)) for n in entry["nodes"]]
        assert len(shares) == 1
        np.testing.assert_allclose(shares[0], want, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.array(entry["carried"]), graph.carried[:, :graph.position + 1].numpy())
        assert entry["label"] == texts[graph.position + 1]
    for title, graph in ((drawn["title"], graphs[0]), (switched["title"], graphs[1])):
        assert f"Δp = {graph.delta_p:+.4f}" in title and "links into the logit" in title
    assert LENGTH == ids.shape[1] and torch.equal(views[1].graph.input_ids, ids[0])
