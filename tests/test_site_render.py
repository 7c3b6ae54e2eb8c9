"""The built documentation site as a reader sees it: every page opened in headless Chromium at a
1280 px wide window, and checked for what the build cannot see.

* No code block or table is wider than its box: its text cut off, or read only by scrolling
  sideways (a table in Material's scrolling wrapper counts too).
* Every page has an h1 heading.
* Every image loads (an img with no natural width is a broken one).

Chromium is driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: no port is
opened), the pages read from the disk (file://; the site is built with the `offline` plugin), and
every name it would look up resolves to nothing, so the pages load what the site holds and no
more. A PNG of each page is saved under the test's temporary folder (printed, and named in a
failure). Chromium is Debian's package: installed with apt-get when missing and the tests run as
root (CI does), otherwise the test skips, or fails under CI (tests/guards.py).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from guards import cannot_run

WIDTH, HEIGHT = 1280, 900
# A box may be this many CSS pixels narrower than its content (sub-pixel rounding) and still pass.
TOLERANCE = 2
_INSTALL = ("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
            "chromium fonts-liberation")

# Run in each page once it has loaded: the problems found, and whether it has an h1.
CHECK_PAGE = """
(async () => {
  if (document.readyState !== 'complete') await new Promise(done => addEventListener('load', done));
  await document.fonts.ready;
  await Promise.all([...document.images].map(img => img.complete ? null
    : new Promise(done => { img.addEventListener('load', done); img.addEventListener('error', done); })));
  // Collapsed blocks (details) are opened, so that what they hold is measured too.
  document.querySelectorAll('details').forEach(d => { d.open = true; });
  const content = document.querySelector('article.md-content__inner') || document.body;
  const right = content.getBoundingClientRect().right;
  const text = el => el.innerText.replace(/\\s+/g, ' ').trim().slice(0, 80);
  // An element is too wide when one of its boxes scrolls (or cuts off) its content, or when it
  // reaches past the page's text column: {width: of its content, box: what shows of it}.
  const tooWide = (el, boxes) => {
    for (const b of boxes)
      if (b.scrollWidth > b.clientWidth + TOLERANCE) return {width: b.scrollWidth, box: b.clientWidth};
    const rect = el.getBoundingClientRect();
    if (rect.right > right + TOLERANCE) return {width: Math.round(rect.width), box: Math.round(right - rect.left)};
    return null;
  };
  const problems = [];
  for (const pre of content.querySelectorAll('pre')) {
    const wide = tooWide(pre, [pre, ...pre.querySelectorAll(':scope > code')]);
    if (wide) problems.push({kind: 'code block', ...wide, text: text(pre)});
  }
  for (const table of content.querySelectorAll('table')) {
    const boxes = [table];
    for (let up = table.parentElement; up && up !== content; up = up.parentElement)
      if (up.matches('.md-typeset__scrollwrap, .md-typeset__table')) boxes.push(up);
    const wide = tooWide(table, boxes);
    if (wide) problems.push({kind: 'table', ...wide, text: text(table)});
  }
  for (const img of document.images) {
    if (img.naturalWidth === 0)
      problems.push({kind: 'broken image', text: img.getAttribute('src')});
  }
  return {url: location.href, problems, h1: [...content.querySelectorAll('h1')].map(text)};
})()
""".replace("TOLERANCE", str(TOLERANCE))


def require_chromium() -> str:
    if not shutil.which("chromium") and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", "-c", _INSTALL], check=False, capture_output=True, timeout=900)
    binary = shutil.which("chromium")
    if not binary:
        cannot_run(f"Chromium is not installed (as root: {_INSTALL})")
    return binary


class Chromium:
    """Headless Chromium, spoken to over the DevTools protocol on a pipe: JSON messages ended by
    a NUL byte, commands on its fd 3, answers and events on its fd 4."""

    def __init__(self, binary: str, profile: Path):
        commands_read, commands_write = os.pipe()
        answers_read, answers_write = os.pipe()
        # The child's ends, moved above the fds the shell sets (3, 4) so that no redirection
        # overwrites another; the shell execs Chromium, which keeps its PID.
        theirs = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in (commands_read, answers_write)]
        os.close(commands_read)
        os.close(answers_write)
        args = [binary, "--headless=new", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars", "--disable-gpu",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--mute-audio",
                # Nothing leaves the machine: every host name resolves to nothing.
                "--host-resolver-rules=MAP * ~NOTFOUND", "--allow-file-access-from-files", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.log = (profile / "chromium.log").open("w")
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{theirs[0]} 4>&{theirs[1]} {theirs[0]}<&- {theirs[1]}>&-', "bash", *args],
            pass_fds=theirs, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)
        for fd in theirs:
            os.close(fd)
        self.write, self.read = commands_write, answers_read
        self.buffer = b""
        self.events: list[dict] = []
        self.next_id = 0

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.write, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._receive(timeout, method)
            if answer.get("id") == self.next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]
            self.events.append(answer)

    def wait_event(self, method: str, session: str, timeout: float = 30) -> dict:
        while True:
            for event in self.events:
                if event.get("method") == method and event.get("sessionId") == session:
                    self.events.remove(event)
                    return event
            self.events.append(self._receive(timeout, method))

    def _receive(self, timeout: float, waiting_for: str) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.read], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer {waiting_for} in {timeout} s")
            chunk = os.read(self.read, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (rc {self.proc.poll()}) before answering {waiting_for}")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self):
        """Browser.close, then the browser's PID and its process group (its renderers), by id."""
        try:
            self.send("Browser.close", timeout=10)
        except (OSError, RuntimeError, TimeoutError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group it led: any child left behind
        except ProcessLookupError:
            pass
        os.close(self.write)
        os.close(self.read)
        self.log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = require_chromium()
    chromium = Chromium(binary, tmp_path_factory.mktemp("chromium-profile"))
    try:
        target = chromium.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = chromium.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        chromium.send("Emulation.setDeviceMetricsOverride",
                      {"width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}, session)
        chromium.send("Page.enable", session=session)
        yield chromium, session
    finally:
        chromium.close()


def site_pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if not {"assets", "search"} & set(p.relative_to(site).parts))


def look_at(browser, page: Path, screenshot: Path) -> dict:
    """Open a page, save its PNG (the whole page), and run CHECK_PAGE in it."""
    chromium, session = browser
    chromium.events.clear()  # a load event left from the page before must not stand for this one's
    chromium.send("Page.navigate", {"url": page.as_uri()}, session)
    chromium.wait_event("Page.loadEventFired", session)
    found = chromium.send("Runtime.evaluate", {"expression": CHECK_PAGE, "awaitPromise": True,
                                               "returnByValue": True}, session)
    if "exceptionDetails" in found:
        raise RuntimeError(f"{page.name}: {found['exceptionDetails']}")
    assert found["result"]["value"]["url"] == page.as_uri()
    shot = chromium.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session)
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    screenshot.write_bytes(base64.b64decode(shot["data"]))
    return found["result"]["value"]


def describe(problem: dict) -> str:
    size = f" ({problem['width']} px wide in a {problem['box']} px box)" if "width" in problem else ""
    return f"{problem['kind']}{size}: {problem['text']!r}"


def test_every_page_fits_a_1280px_window_has_an_h1_and_its_images(built_site, browser, tmp_path_factory):
    shots = tmp_path_factory.mktemp("site-screenshots")
    print(f"screenshots of every page: {shots}")
    pages = site_pages(built_site)
    assert len(pages) > 20, pages  # every page of the nav, not a handful
    failures = []
    for page in pages:
        name = page.relative_to(built_site).as_posix()
        found = look_at(browser, page, shots / name.replace(".html", ".png"))
        failures += [f"{name}: {describe(p)}" for p in found["problems"]]
        if not found["h1"]:
            failures.append(f"{name}: no h1 heading")
    assert not failures, f"{len(failures)} problems at {WIDTH} px (screenshots in {shots}):\n" + "\n".join(failures)


def test_the_check_finds_an_over_wide_code_block_and_table_and_a_broken_image(browser, tmp_path):
    """The page check on a page made to fail: what it must catch, it catches; what fits passes."""
    long = "x" * 300
    page = tmp_path / "wide.html"
    page.write_text(f"""<!doctype html><html><body><article class="md-content__inner" style="width: 800px">
<pre><code>{long}</code></pre>
<pre style="white-space: pre-wrap"><code>{" ".join([long[:60]] * 5)}</code></pre>
<table><tr><td style="white-space: nowrap">{long}</td></tr></table>
<table><tr><td>{" ".join([long[:60]] * 5)}</td></tr></table>
<img src="missing.png" alt="">
</article></body></html>""")
    found = look_at(browser, page, tmp_path / "wide.png")
    assert [p["kind"] for p in found["problems"]] == ["code block", "table", "broken image"], found
    assert found["problems"][0]["text"] == "x" * 80
    assert found["h1"] == []
