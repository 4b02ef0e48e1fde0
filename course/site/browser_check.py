"""The site checked in a real browser (given): `python main.py site --check` builds the site, then runs this.

One headless Chromium (Debian's `chromium`) opens every page of the built site from file://, as a learner
opening results/site/index.html would, and is driven through its DevTools protocol over a pipe
(--remote-debugging-pipe: JSON messages on its file descriptors 3 and 4), so no Python package is needed.
On every page: no console error, no uncaught exception, no failed request and no request out of the site;
every image drawn; every link into the site reaching a file that exists; the maths typeset by KaTeX (no
TeX left unrendered, no KaTeX error). A notebook page shows its outputs (a plot); a chapter page shows every
figure the manifest (course/site/figures.py) gives it, and chapters 01-19 their typeset maths. The explorer, opened
at a few (schedule, p, m) through its address, shows the bubble the course's simulator gives. The layout
calculator, opened at a sample of layouts of each case, prints the row (or the refusal) that `python main.py
plan` prints for the same layout pinned, and the command that does it; the hardware page shows every GPU
preset and its roofline. Screenshots of a chapter, a notebook, the explorer, the calculator and the hardware
page go to results/site-screenshots/.
"""
from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path
from urllib.parse import unquote, urlsplit

from course import REPO, RESULTS

SCREENSHOTS = RESULTS / "site-screenshots"
MATHS_CHAPTERS = tuple(f"{n:02d}" for n in range(1, 20))  # chapters whose pages must show typeset maths (KaTeX)
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL = ("the browser check needs Chromium, which was not found: install it with `sudo apt-get install chromium` "
           "(Debian/Ubuntu; `chromium-browser` elsewhere), then run `python main.py site --check` again")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         "--disable-default-apps", "--hide-scrollbars", "--mute-audio", "--allow-file-access-from-files",
         "--host-resolver-rules=MAP * ~NOTFOUND"]  # a request to any host fails at once (and is reported)

# What the check reads off a page once it has loaded and its scripts have run.
INSPECT = """(() => {
  const all = (selector) => Array.from(document.querySelectorAll(selector));
  return {
    title: document.title,
    links: all("a[href]").map((a) => a.href),
    broken_images: all("img").filter((img) => !img.complete || img.naturalWidth === 0).map((img) => img.src),
    math: all(".math").length,
    typeset: all(".math .katex").length,
    katex: all(".katex").length,
    katex_errors: all(".katex-error").map((e) => e.textContent.slice(0, 80)),
    plots: all(".cell_output img").length,
    outputs: all(".cell_output").length,
    figures: all("figure[id] img").filter((img) => img.complete && img.naturalWidth > 0)
      .map((img) => img.closest("figure").id),
  };
})()"""
EXPLORER_READY = "document.getElementById('explorer-status')?.dataset.ready"
CALCULATOR_READY = "document.getElementById('calculator-status')?.dataset.ready"
CALCULATOR_READ = """(() => ({
  layout: document.getElementById('calculator-output')?.dataset.layout,
  row: document.getElementById('calculator-plan')?.dataset.row,
  miss: document.getElementById('calculator-plan')?.dataset.miss,
  command: document.getElementById('calculator-command')?.textContent,
  memory: document.getElementById('calculator-memory')?.dataset.total,
}))()"""
EXPLORER_READ = """(() => ({
  config: document.getElementById('explorer-output').dataset.config,
  bubble: document.getElementById('bubble-simulated')?.dataset.value,
  closed: document.getElementById('bubble-closed')?.dataset.value,
  refused: document.getElementById('refused')?.textContent,
  blocks: document.querySelectorAll('.explorer-timeline .action').length,
  katex: document.querySelectorAll('#closed-form .katex').length,
}))()"""


def find_chromium() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


class Browser:
    """Headless Chromium on a pipe: send() a DevTools command and get its result; events are kept per page."""

    def __init__(self, executable: str, timeout: float = 30):
        self.timeout, self.next_id = timeout, 0
        self.profile = tempfile.TemporaryDirectory(prefix="course-chromium-")
        # fd 3 reads the commands, fd 4 writes the answers: our stdin and stdout, moved there by the shell.
        self.process = subprocess.Popen(
            ["sh", "-c", 'exec "$0" "$@" 3<&0 4>&1 </dev/null >/dev/null', executable, *FLAGS,
             f"--user-data-dir={self.profile.name}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.messages, self.events = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()
        try:
            target = self.send("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.send("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            for domain in ("Page", "Runtime", "Log", "Network"):
                self.send(f"{domain}.enable", session=True)
            self.send("Emulation.setDeviceMetricsOverride", session=True, width=1280, height=1800,
                      deviceScaleFactor=1, mobile=False)  # a laptop's window: pages laid out, and shot, this wide
        except BaseException:
            self.close()
            raise

    def _read(self):
        buffer = b""
        while chunk := self.process.stdout.read1(1 << 16):
            buffer += chunk
            *whole, buffer = buffer.split(b"\0")
            for message in whole:
                self.messages.put(json.loads(message))
        self.messages.put(None)  # the browser is gone

    def _next(self, deadline: float) -> dict:
        try:
            message = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"the browser did not answer within {self.timeout:.0f} s") from None
        if message is None:
            raise RuntimeError("the browser quit")
        return message

    def send(self, method: str, session: bool = False, **params) -> dict:
        self.next_id += 1
        command = {"id": self.next_id, "method": method, "params": params}
        if session:
            command["sessionId"] = self.session
        self.process.stdin.write(json.dumps(command).encode() + b"\0")
        self.process.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._next(deadline)
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error'].get('message')}")
                return message.get("result", {})
            if "method" in message:
                self.events.append(message)

    def wait_for_event(self, method: str):
        deadline = time.monotonic() + self.timeout
        while not any(e["method"] == method for e in self.events):
            message = self._next(deadline)
            if "method" in message:
                self.events.append(message)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", session=True, expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluating on the page failed: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def open(self, url: str, ready: str | None = None) -> list[str]:
        """Load `url` and wait until it has loaded (and `ready`, an expression, is "1"); return what went wrong
        meanwhile: console errors, exceptions, failed requests and requests out of the site."""
        self.events.clear()
        self.send("Page.navigate", session=True, url=url)
        self.wait_for_event("Page.loadEventFired")
        deadline = time.monotonic() + self.timeout
        while ready and self.evaluate(ready) != "1":
            if time.monotonic() > deadline:
                return [f"not ready after {self.timeout:.0f} s ({ready!r} is {self.evaluate(ready)!r})"]
            time.sleep(0.05)
        self.evaluate("document.fonts.ready.then(() => true)")
        self.send("Runtime.evaluate", session=True, expression="0")  # collects the events sent meanwhile
        return problems_in(self.events)

    def screenshot(self, path: Path, height: int = 1800, top: float = 0):
        """`height` pixels of the page from `top` down, 1280 wide."""
        data = self.send("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": top, "width": 1280, "height": height, "scale": 1})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # the browser and the helpers it started, nothing else
        except ProcessLookupError:
            pass
        self.process.wait()
        self.profile.cleanup()


def problems_in(events: list[dict]) -> list[str]:
    problems, urls = [], {}
    for event in events:
        method, params = event["method"], event.get("params", {})
        if method == "Network.requestWillBeSent":
            url = params["request"]["url"]
            urls[params["requestId"]] = url
            if not url.startswith(("file:", "data:", "blob:", "about:")):
                problems.append(f"requests {url}, out of the site")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            problems.append(f"failed to load {urls.get(params['requestId'], '?')}: {params.get('errorText')}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            problems.append(f"uncaught exception: {details.get('exception', {}).get('description') or details['text']}")
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            problems.append("console error: " + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            problems.append(f"console error: {params['entry']['text']} {params['entry'].get('url', '')}".rstrip())
    return problems


def link_problems(links: list[str], site: Path) -> list[str]:
    """The links into the site (file:// URLs under it) that name no file."""
    problems = []
    for link in links:
        parts = urlsplit(link)
        if parts.scheme == "file" and Path(unquote(parts.path)).resolve().is_relative_to(site.resolve()):
            if not Path(unquote(parts.path)).exists():
                problems.append(f"links to {link}, which is not in the site")
    return problems


def explorer_cases() -> list[tuple[dict, Fraction | None]]:
    """(the explorer's address query, the bubble course/simulate.py gives, or None where the schedule refuses
    the arguments): every schedule at p = 4, m = 8, and a few other points of the grid."""
    from course.impl import reference
    from course.simulate import Costs, simulate_schedule

    generators = reference("m11_generators")
    cases = [{"schedule": name, "p": 4, "m": 8} for name in generators.SCHEDULES]
    cases += [{"schedule": "1f1b", "p": 2, "m": 3}, {"schedule": "zbh1", "p": 4, "m": 8, "F": 2},
              {"schedule": "interleaved", "p": 2, "m": 4, "v": 3, "W": 2}, {"schedule": "zbv", "p": 4, "m": 4}]
    expected = []
    for case in cases:
        if case["schedule"] not in generators.SCHEDULES:
            continue
        costs = Costs(*(Fraction(case.get(kind, 1)) for kind in "FIW"))
        try:
            schedule = generators.make_schedule(case["schedule"], case["p"], case["m"], case.get("v", 2))
        except ValueError:
            expected.append((case, None))
            continue
        expected.append((case, simulate_schedule(schedule.orders, schedule.placement, costs).bubble))
    return expected


def check_explorer(browser: Browser, site: Path) -> tuple[int, list[str]]:
    problems, checked = [], 0
    for case, bubble in explorer_cases():
        query = "&".join(f"{k}={v}" for k, v in case.items())
        where = f"explorer.html?{query}"
        found = [f"{where}: {p}" for p in browser.open(f"{(site / 'explorer.html').as_uri()}?{query}", EXPLORER_READY)]
        shown = browser.evaluate(EXPLORER_READ)
        if bubble is None:
            if not shown.get("refused"):
                found.append(f"{where}: the schedule refuses these arguments, but the page shows no refusal")
        elif shown.get("bubble") is None or Fraction(shown["bubble"]) != bubble:
            found.append(f"{where}: the page shows a bubble of {shown.get('bubble')}, the simulator gives {bubble}")
        elif shown["blocks"] == 0 or (shown.get("closed") is not None and shown["katex"] == 0):
            found.append(f"{where}: no timeline drawn, or the closed form not typeset: {shown}")
        problems += found
        checked += 1
        print(f"  {'ok  ' if not found else 'FAIL'} {where}: bubble {shown.get('bubble') or 'refused'}"
              f"{'' if bubble is None else f' (simulator: {bubble})'}", flush=True)
    browser.open(f"{(site / 'explorer.html').as_uri()}?schedule=zbv&p=4&m=8", EXPLORER_READY)
    browser.screenshot(SCREENSHOTS / "explorer.png", height=1500)
    return checked, problems


def calculator_samples(case) -> list:
    """Layouts of a case to open on the calculator: the fastest that fits, the fastest of two other meshes
    (pipelined where there is one), one with FP8 and one that does not fit, as module 18's functions cost
    them when the site was built."""
    from course.site import calculator

    costed = calculator.costed(case)
    fits = calculator.fastest(case, len(costed))
    picks = calculator.fastest(case, 3, one_per_mesh=True)
    picks += [q for q in fits if q.layout.p > 1][:1] + [q for q in fits if q.layout.fp8][:1]
    picks += [q for q in costed if q.time is None][:1]
    unique = {}
    for q in picks:
        unique.setdefault(str(q.layout), q)
    return list(unique.values())


def normalised(text: str | None) -> str:
    return " ".join((text or "").split())


def plan_prints(arguments: list[str]) -> str:
    """What `python main.py plan` prints for one pinned layout: its row (the rank left out) or its error."""
    done = subprocess.run([sys.executable, "main.py", "plan", *arguments], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "COURSE_IMPL": "solutions"})
    if done.returncode:
        return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
    rows = [line for line in done.stdout.splitlines() if line.strip().startswith("1  ")]
    return rows[0].strip()[1:].strip() if len(rows) == 1 else done.stdout


def check_calculator(browser: Browser, site: Path) -> tuple[int, list[str]]:
    """For a sample of layouts of every case: the page, opened at the layout through its address, shows the
    row (or the refusal) that `python main.py plan` prints for the layout pinned, and that command."""
    from course.site import calculator

    problems, checked = [], 0
    for case in calculator.CASES:
        for q in calculator_samples(case):
            layout = q.layout
            query = {"case": case.key, "mesh": calculator.mesh_key(layout),
                     **{name: ("on" if layout.fp8 else "off") if name == "fp8" else calculator.choice(layout, name)
                        for name in calculator.CHOICES}}
            address = "&".join(f"{k}={v}" for k, v in query.items())
            where = f"calculator.html?{address}"
            found = [f"{where}: {p}" for p in browser.open(f"{(site / 'calculator.html').as_uri()}?{address}",
                                                           CALCULATOR_READY)]
            shown = browser.evaluate(CALCULATOR_READ)
            arguments = calculator.plan_command(case, layout)
            printed = plan_prints(arguments)
            if shown.get("layout") != str(layout):
                found.append(f"{where}: the page shows the layout {shown.get('layout')!r}, not {str(layout)!r}")
            elif normalised(shown.get("command")) != normalised("python main.py plan " + " ".join(arguments)):
                found.append(f"{where}: the page's command is {shown.get('command')!r}, expected "
                             f"python main.py plan {' '.join(arguments)}")
            elif normalised(shown.get("row") or shown.get("miss")) != normalised(printed):
                found.append(f"{where}: the page shows\n    {shown.get('row') or shown.get('miss')}\n  python main.py "
                             f"plan {' '.join(arguments)} prints\n    {printed}")
            elif int(shown.get("memory") or -1) != q.memory:
                found.append(f"{where}: the memory bars add up to {shown.get('memory')} bytes, the plan's layout "
                             f"keeps {q.memory}")
            problems += found
            checked += 1
            print(f"  {'ok  ' if not found else 'FAIL'} {where}: {normalised(printed)[:110]}", flush=True)
    browser.open(f"{(site / 'calculator.html').as_uri()}?case={calculator.CASES[-1].key}", CALCULATOR_READY)
    browser.screenshot(SCREENSHOTS / "calculator.png", height=2200)
    return checked, problems


def check_hardware(browser: Browser, site: Path) -> tuple[int, list[str]]:
    """The hardware page names every GPU preset and draws the roofline."""
    from course.impl import reference

    page = site / "hardware.html"
    problems = [f"hardware.html: {p}" for p in browser.open(page.as_uri())]
    text = browser.evaluate("document.body.innerText")
    drawn = browser.evaluate("Array.from(document.images).filter((i) => i.naturalWidth > 0).map((i) => i.src)")
    problems += [f"hardware.html: no row for the {gpu.name}" for gpu in reference("m18_presets").GPUS.values()
                 if gpu.name not in text]
    if not any("roofline" in src for src in drawn):
        problems.append("hardware.html: the roofline is not drawn")
    browser.screenshot(SCREENSHOTS / "hardware.png", height=2000)
    print(f"  {'ok  ' if not problems else 'FAIL'} hardware.html: every preset, the roofline", flush=True)
    return 1, problems


def check_pages(browser: Browser, site: Path) -> tuple[int, list[str]]:
    from course.site import figures

    pages = sorted(p for p in site.rglob("*.html") if not p.relative_to(site).parts[0].startswith("_"))
    problems, plots = [], 0
    for page in pages:
        where = str(page.relative_to(site))
        ready = {"explorer.html": EXPLORER_READY, "calculator.html": CALCULATOR_READY}.get(page.name)
        found = browser.open(page.as_uri(), ready)
        seen = browser.evaluate(INSPECT)
        found += [f"image not drawn: {src}" for src in seen["broken_images"]]
        found += link_problems(seen["links"], site)
        if seen["math"] != seen["typeset"] or seen["katex_errors"]:
            found.append(f"maths not typeset: {seen['typeset']} of {seen['math']} formulas; "
                         f"KaTeX errors: {seen['katex_errors']}")
        if page.parent.name == "notebooks":
            plots += seen["plots"]
            if not seen["outputs"]:
                found.append("a notebook page with no outputs (were the notebooks executed?)")
        if page.parent.name == "docs" and page.name[:2].isdigit():
            expected = [f"fig-{f.name}" for f in figures.of_chapter(page.name[:2])]
            found += [f"figure {name} of the manifest not drawn" for name in expected if name not in seen["figures"]]
            if page.name[:2] in MATHS_CHAPTERS and not seen["typeset"]:
                found.append("no maths typeset (the chapter's $ formulas)")
        problems += [f"{where}: {p}" for p in found]
        print(f"  {'ok  ' if not found else 'FAIL'} {where}: {seen['katex']} formulas typeset, "
              f"{len(seen['links'])} links" + (f", {seen['outputs']} outputs, {seen['plots']} plots"
                                               if page.parent.name == "notebooks" else ""), flush=True)
    if not plots:
        problems.append("no notebook page shows a plot")
    chapter = next((p for p in pages if p.parent.name == "docs" and p.name.startswith("05")), pages[0])
    browser.open(chapter.as_uri())
    top = browser.evaluate("Math.max(0, (document.getElementById('fig-05-bubble')?.getBoundingClientRect().top "
                           "?? 0) + window.scrollY - 900)")
    browser.screenshot(SCREENSHOTS / "chapter.png", top=top)
    notebook = next((p for p in pages if p.parent.name == "notebooks" and p.name.startswith("11")), None)
    if notebook:
        browser.open(notebook.as_uri())
        browser.screenshot(SCREENSHOTS / "notebook.png", height=2400)
    return len(pages), problems


def check(site: Path) -> int:
    """Check the built site in `site` in headless Chromium; print one line per page and configuration, then
    the problems; return the exit status (0: all passed, 1: a check failed, 2: no Chromium)."""
    from course.site.html_check import check_site

    executable = find_chromium()
    if executable is None:
        print(f"error: {INSTALL}")
        return 2
    started = time.perf_counter()
    problems = check_site(site)  # the HTML itself, first: quicker to read than what a browser makes of it
    browser = Browser(executable)
    try:
        print(f"browser check: {executable}, pages of {site}")
        n_pages, found = check_pages(browser, site)
        n_cases, more = check_explorer(browser, site)
        n_layouts, on_calculator = check_calculator(browser, site)
        n_hardware, on_hardware = check_hardware(browser, site)
    finally:
        browser.close()
    problems += found + more + on_calculator + on_hardware
    n_cases += n_layouts + n_hardware
    print("\n".join(["", *problems]) if problems else "",
          f"browser check: {n_pages} pages and {n_cases} configurations of the explorer, the calculator and the "
          f"hardware page in "
          f"{time.perf_counter() - started:.0f} s; screenshots in {SCREENSHOTS}", sep="\n")
    failed = len({p.split(":")[0] for p in problems})
    print(f"browser-check: {n_pages + n_cases - failed} passed, {failed} failed")
    return 1 if problems else 0
