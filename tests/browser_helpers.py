"""JupyterLab server and Playwright page helpers for tests/test_browser.py.

The test drives the course the way a learner does: a real JupyterLab, a real (headless)
Chromium, Run > Run All Cells, then it reads what the page shows. This module holds the
plumbing: starting an isolated JupyterLab on loopback, stopping it without leaving a
process behind, and reading a notebook's rendered cells.
"""
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil  # a dependency of ipykernel, so always in the venv

from conftest import alive, free_port  # tests/ is on sys.path under pytest

CHROMIUM = Path("/usr/bin/chromium")  # Debian's package, installed by .ci/install_browser.sh
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

@contextlib.contextmanager
def chromium_context(profile, missing):
    """A headless Chromium (Playwright's persistent context, Debian's binary, a 1280 x 900 viewport) with its
    profile in ``profile``; ``missing(what)`` is called (it skips or fails the test) when Playwright is absent."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900})
        try:
            yield context
        finally:
            context.close()


# JupyterLab user settings for the test server. windowingMode "none" keeps every cell in the DOM
# (the default only lays out cells near the viewport); the notifications would otherwise ask
# about news over the notebook and try to reach the internet.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}


class JupyterLab:
    """One JupyterLab on 127.0.0.1 with a random token, serving ``root`` (a temporary directory laid out as the
    repository is for a learner: the README and ``my-notebooks/``, the copy that `make lab` makes).

    Everything it writes (settings, workspaces, runtime files, executed notebooks) stays under
    ``tmp``, so running cells never touches the repository.
    """

    def __init__(self, root: Path, tmp: Path):
        self.tmp = tmp
        self.root = root
        self.token = secrets.token_hex(24)
        self.log_path = tmp / "jupyterlab.log"
        self.proc = None
        self.port = None
        self._seen = {}  # pid -> psutil.Process of every server descendant seen (kernels, ranks)

    # ---- start / stop -------------------------------------------------------------------
    def start(self, timeout=90.0, attempts=4):
        settings = self.tmp / "lab-settings"
        for name, values in LAB_SETTINGS.items():
            path = settings / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        venv_bin = str(Path(sys.executable).parent)
        env = dict(os.environ,
                   PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),  # the venv's kernel
                   JUPYTER_CONFIG_DIR=str(self.tmp / "config"),  # no user config, kernels or extensions
                   JUPYTER_DATA_DIR=str(self.tmp / "data"),
                   JUPYTER_RUNTIME_DIR=str(self.tmp / "runtime"),
                   IPYTHONDIR=str(self.tmp / "ipython"),
                   PYTHONUNBUFFERED="1")
        for var in ("JUPYTER_PATH", "JUPYTER_PLATFORM_DIRS", "JUPYTER_TOKEN", "JUPYTER_PORT", "MPLBACKEND"):
            env.pop(var, None)
        for attempt in range(attempts):
            # jupyter_server reads back a --port=0 port only since 2.20 (older ones advertise port 0), so probe a
            # free port; if another process takes it before the server binds it, the loop retries.
            self.port = free_port()
            cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
                   "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
                   f"--ServerApp.root_dir={self.root}", f"--LabApp.user_settings_dir={settings}",
                   f"--LabApp.workspaces_dir={self.tmp / 'workspaces'}", "--ServerApp.terminals_enabled=False"]
            if os.geteuid() == 0:  # CI containers run as root; JupyterLab refuses that unless told
                cmd.append("--allow-root")
            log = open(self.log_path, "w")
            # Its own session, so that stop() can signal the server without touching pytest.
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    self.api("GET", "/api/status", timeout=2)
                    return self
                except (OSError, urllib.error.URLError):
                    time.sleep(0.3)
            else:
                self._kill_server()
                raise RuntimeError(f"JupyterLab did not answer within {timeout:.0f} s; its log:\n{self.log_tail()}")
            if "is not available" not in self.log_path.read_text(errors="replace"):
                raise RuntimeError(f"JupyterLab exited with code {self.proc.returncode}; its log:\n{self.log_tail()}")
            # Another process took the probed port between the probe and the server's bind: retry.
        raise RuntimeError(f"JupyterLab found no free port in {attempts} attempts; its log:\n{self.log_tail()}")

    def log_tail(self, n=40):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def notebook_url(self, name):
        # A workspace per notebook: two tabs on the default workspace fight over its layout.
        workspace = "".join(ch if ch.isalnum() else "-" for ch in name)
        return f"{self.url}/lab/workspaces/{workspace}/tree/{name}?token={self.token}"

    def api(self, method, path, timeout=10):
        req = urllib.request.Request(self.url + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
        return json.loads(body) if body else None

    def _remember_descendants(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self._seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def shutdown_kernels(self, timeout=30.0):
        """Shut every kernel down through the REST API (the kernels end their %%ddp ranks)."""
        self._remember_descendants()
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=timeout)
        deadline = time.monotonic() + timeout
        while self.api("GET", "/api/kernels") and time.monotonic() < deadline:
            time.sleep(0.2)

    def stop(self, timeout=30.0):
        """Kernels first (REST), then the server; returns descriptions of processes that outlived it.

        Whatever is left over is killed, so that a failing test still leaves a clean machine.
        """
        if self.proc is None:
            return []
        leftovers = []
        if self.proc.poll() is None:
            try:
                self.shutdown_kernels(timeout)
            except (OSError, urllib.error.URLError):
                pass
            self._remember_descendants()
            try:
                self.api("POST", "/api/shutdown")
            except (OSError, urllib.error.URLError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                leftovers.append(f"pid {self.proc.pid}: the JupyterLab server, up {timeout:.0f} s after /api/shutdown")
                self._kill_server()
        self.proc = None
        deadline = time.monotonic() + timeout
        for p in self._seen.values():
            while alive(p) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(p):
                try:
                    leftovers.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        return leftovers

    def _kill_server(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the session start() created for the server
        except ProcessLookupError:
            pass
        self.proc.wait(10)


# ---- reading a notebook in the page -------------------------------------------------------

# One entry per cell of the open notebook, in order, with what the learner sees.
READ_CELLS_JS = """
(panel) => Array.from(panel.querySelectorAll('.jp-Notebook .jp-Cell')).map(cell => ({
    kind: cell.classList.contains('jp-CodeCell') ? 'code'
        : cell.classList.contains('jp-MarkdownCell') ? 'markdown' : 'raw',
    prompt: (cell.querySelector('.jp-InputPrompt') || {}).innerText || '',
    output: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(o => o.innerText).join('\\n'),
    // JupyterLab renders error outputs and stderr streams alike, as application/vnd.jupyter.stderr.
    stderr: Array.from(cell.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]'))
        .map(o => o.innerText),
    images: Array.from(cell.querySelectorAll('.jp-OutputArea-output img'))
        .map(img => ({src: img.src, width: img.naturalWidth, height: img.naturalHeight})),
}))
"""


def notebook_panel(page):
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)").last


def kernel_status(page):
    """'idle', 'busy', ... as the notebook toolbar's execution indicator shows it."""
    indicator = notebook_panel(page).locator(".jp-Notebook-ExecutionIndicator").first
    return indicator.get_attribute("data-status") if indicator.count() else None


def read_cells(page):
    panel = notebook_panel(page)
    return panel.element_handle().evaluate(READ_CELLS_JS) if panel.count() else []


def kernel_state(lab, name):
    """The server's view of the kernel of notebook ``name``: 'idle', 'busy', ... or None."""
    for session in lab.api("GET", "/api/sessions"):
        if session.get("path") == name and session.get("kernel"):
            return session["kernel"].get("execution_state")
    return None


def open_notebook(page, lab, name, n_cells, timeout=120.0):
    """Open ``name`` in JupyterLab and wait until all its cells are rendered and its kernel is idle."""
    page.goto(lab.notebook_url(name))
    wait_for(lambda: len(read_cells(page)) == n_cells, timeout,
             lambda: f"{name}'s {n_cells} cells to render (the page shows {len(read_cells(page))})")
    wait_for(lambda: kernel_state(lab, name) == "idle" and kernel_status(page) == "idle", timeout,
             lambda: f"the kernel of {name} to start (server: {kernel_state(lab, name)!r}, "
                     f"page: {kernel_status(page)!r})")


def menu(page, top, item):
    """Click menu bar entry ``top``, then its item labelled exactly ``item`` (as a learner would)."""
    page.locator(".lm-MenuBar-item").get_by_text(top, exact=True).click()
    page.locator(".lm-Menu").get_by_text(item, exact=True).click()


def _prompts(page):
    return [c["prompt"].strip() for c in read_cells(page) if c["kind"] == "code"]


def run_all_cells(page, lab, name, timeout=300.0):
    """Clear the stored outputs, Run > Run All Cells, and wait until the kernel is idle with no cell queued.

    Clearing first means every output the test then reads was produced in this browser session.
    """
    menu(page, "Edit", "Clear Outputs of All Cells")
    wait_for(lambda: all(p in ("", "[ ]:") for p in _prompts(page)), 30, f"the outputs of {name} to clear")
    menu(page, "Run", "Run All Cells")
    wait_for(lambda: any(p not in ("", "[ ]:") for p in _prompts(page)), 30, f"Run All Cells to start in {name}")

    def finished():
        # Run All marks every cell it queues [*] at once; a cell's prompt becomes [N] on its execute_reply (or
        # [ ] when an error aborts the rest of the queue). No [*] left means nothing is queued or running; the
        # kernel is briefly idle between two queued cells, so idle alone would not do.
        return ("[*]:" not in _prompts(page) and kernel_status(page) == "idle"
                and kernel_state(lab, name) == "idle")

    # a lesson runs for tens of seconds: a poll a second (each reads every prompt in the page and asks the server)
    wait_for(finished, timeout, lambda: f"the cells of {name} to finish (kernel: page {kernel_status(page)!r}, "
                                        f"server {kernel_state(lab, name)!r}; prompts {_prompts(page)})", every=1.0)


def save_notebook(page, lab, name, timeout=30.0):
    """File > Save Notebook; returns the saved notebook (JSON) as the browser's model holds it."""
    path = lab.root / name
    before = path.stat().st_mtime_ns
    menu(page, "File", "Save Notebook")
    wait_for(lambda: path.stat().st_mtime_ns != before and not page.locator(".lm-TabBar-tab.jp-mod-dirty").count(),
             timeout, f"{name} to be saved")
    return json.loads(path.read_text())


def wait_for(predicate, timeout, what, every=0.25):
    """Poll ``predicate`` every ``every`` seconds until it is true; fail after ``timeout`` seconds, saying ``what``
    was awaited (a string, or a function returning one, so that the message shows the state at the deadline)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")


# ---- a probe site: one lesson with reveal cells, built with docs/conf.py ---------------------------------------

PROBE_LESSON = "99_probe.ipynb"
PROBE_SECRET_MD = "The markdown answer: every rank holds 46."  # inside the markdown reveal cell only
PROBE_SECRET_CODE = "probe_code_answer = 46"                    # inside the code reveal cell only
PROBE_SECRET_OUTPUT = "the stored output of the code reveal cell"
PROBE_OPEN = "Predict first: what does every rank hold?"        # an ordinary cell, shown open
PROBE_CONF = """
__file__ = {conf!r}             # docs/conf.py finds the repository from its own path
exec(compile(open({conf!r}).read(), {conf!r}, "exec"))
ROOT = Path({src!r})            # the probe's folder in place of the repository: one lesson, a README
LESSONS = [{lesson!r}]
include_patterns = ["README.md", "CONTRIBUTING.md", "notebooks/[0-9][0-9]_*.ipynb"]
exclude_patterns = []
html_theme_options = {{**html_theme_options, "repository_url": "https://github.com/example/probe"}}
"""


def probe_lesson():
    """A lesson holding a prediction, its run and two reveal cells (markdown with a ``:`` first line and a fenced
    block, then code with an output), and a last ordinary cell."""
    import nbformat.v4 as v4

    cells = [v4.new_markdown_cell("# 99 · Probe\n\n**Predict**\n\n" + PROBE_OPEN),
             v4.new_code_cell("x = 46", execution_count=1),
             v4.new_markdown_cell(f": a first line with a colon\n\n{PROBE_SECRET_MD}\n\n```python\nx == 46\n```",
                                  metadata={"tags": ["reveal"], "answer": ["46"]}),
             v4.new_code_cell(PROBE_SECRET_CODE + "\nprint('" + PROBE_SECRET_OUTPUT + "')", execution_count=2,
                              outputs=[v4.new_output("stream", text=PROBE_SECRET_OUTPUT + "\n")],
                              metadata={"tags": ["reveal"]}),
             v4.new_markdown_cell("After the answer: the lesson goes on.")]
    nb = v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def build_probe_site(tmp: Path):
    """Build the probe lesson with the course's docs/conf.py (its source-read hook and directive) into ``tmp/html``,
    warnings as errors, as `make site` builds; returns the probe lesson's page."""
    import nbformat

    root = Path(__file__).resolve().parent.parent
    src, confdir = tmp / "src", tmp / "conf"
    (src / "notebooks").mkdir(parents=True)
    confdir.mkdir()
    shutil.copytree(root / "docs" / "_static", confdir / "_static")
    (src / "README.md").write_text("# Probe\n\n## Quick start\n\n### Kaggle (2 x T4) and Colab\n\n"
                                   "```python\n!pip install <this repository's URL>\n```\n")
    (src / "CONTRIBUTING.md").write_text("# Contributing\n")
    nbformat.write(probe_lesson(), src / "notebooks" / PROBE_LESSON)
    (confdir / "conf.py").write_text(PROBE_CONF.format(conf=str(root / "docs" / "conf.py"), src=str(src),
                                                       lesson=PROBE_LESSON))
    run = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-n", "-q",
                          "-c", str(confdir), "-d", str(tmp / "doctrees"), str(src), str(tmp / "html")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the probe site did not build:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return tmp / "html" / "notebooks" / PROBE_LESSON.replace(".ipynb", ".html")
