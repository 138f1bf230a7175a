"""The course as a learner sees it: JupyterLab in headless Chromium, Run > Run All Cells, then read the page.

    .venv/bin/python -m pytest tests/test_browser.py -p no:randomly

Needs /usr/bin/chromium (.ci/install_browser.sh installs it; Playwright drives it and never
downloads a browser of its own). Without it the test is skipped, except when CI=true: there a
skip would hide that the browser test never ran, so it fails. One JupyterLab serves a temporary
learner's copy for the whole module: the temporary root holds the README and my-notebooks/, made by
scripts/learner_copy.py exactly as `make lab` makes it (outputs cleared), so the test opens each lesson as a
learner does, sees no stored output, and running cells never modifies the repository.
A timing log goes to a temporary directory (printed in the log of the test's setup), or to $BROWSER_ARTIFACTS when
set, and then screenshots too (of the page after Run All and of each cell a test checks; test-artifacts/ is
git-ignored for that: BROWSER_ARTIFACTS=test-artifacts/browser). Without it no screenshot is taken: each costs
Chromium a render and a PNG encoding, for a file that nobody reads.

A probe lesson (browser_helpers.probe_lesson: a markdown and a code cell tagged ``reveal``), built with docs/conf.py,
shows in Chromium that the site folds an answer until the reader clicks it.
The course's static site (`make site`) is checked in Chromium by tests/test_site.py, with the same Chromium and
arguments (browser_helpers): there one build serves its page checks and its browser checks.
"""
import json
import os
import re
import shutil
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import learner_copy  # noqa: E402
from browser_helpers import (CHROMIUM, PROBE_OPEN, PROBE_SECRET_CODE, PROBE_SECRET_MD, PROBE_SECRET_OUTPUT, JupyterLab,
                             build_probe_site, chromium_context, notebook_panel, open_notebook, read_cells,
                             run_all_cells, save_notebook, wait_for)
from conftest import NOTEBOOKS, ROOT, in_ci

LESSONS = ["00_launcher_tour.ipynb", "10_tradeoffs.ipynb"]
COPY = "my-notebooks"  # the learner's copy, as `make lab` names it
# The cost-model controls of 10_tradeoffs, by their descriptions; moving any of them redraws the plot.
CONTROLS = ["world size", "model size", "bandwidth", "latency", "micro-batch", "accum steps", "compression"]
RANK_LINE = re.compile(r"^\[rank (\d+)\] ", re.M)
SCREENSHOTS = bool(os.environ.get("BROWSER_ARTIFACTS"))  # only where someone keeps them


# How a learner's machine without Chromium (or without apt) runs everything else, on purpose; the Makefile and
# the README say the same. TESTS holds no test path, so pytest still runs its testpaths, minus this module.
LEAVE_OUT = "make test TESTS=--deselect=tests/test_browser.py"


def _missing(what):
    message = (f"{what}: on Debian/Ubuntu .ci/install_browser.sh installs chromium (and `make test` installs the "
               f"test extras); to leave the browser test out on purpose: {LEAVE_OUT}")
    if in_ci():
        pytest.fail(f"{message}. CI=true, where a skipped browser test would hide that it never ran.")
    pytest.skip(message)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not CHROMIUM.exists():
        _missing(f"{CHROMIUM} is not installed")
    tmp = tmp_path_factory.mktemp("jupyterlab")
    root = tmp / "course"
    learner_copy.sync(NOTEBOOKS, root / COPY)
    shutil.copy(ROOT / "README.md", root / "README.md")  # the lessons link to ../README.md
    lab = JupyterLab(root, tmp).start()
    yield lab
    # Kernels through the REST API, then the server; whatever outlives them is killed and reported
    # here, as an error in the teardown of the module's last test.
    leftovers = lab.stop()
    assert not leftovers, f"processes outlived JupyterLab's shutdown (killed now): {leftovers}"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Where the timing log (and with $BROWSER_ARTIFACTS, screenshots) go: that folder, or a temporary one."""
    where = os.environ.get("BROWSER_ARTIFACTS")
    path = Path(where).resolve() if where else tmp_path_factory.mktemp("browser-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    print(f"browser test artifacts: {path}")
    return path


@pytest.fixture(scope="module")
def browser(lab, tmp_path_factory):
    with chromium_context(tmp_path_factory.mktemp("chromium-profile"), _missing) as context:
        yield context


class Lesson:
    """One lesson after Run All Cells in the browser: the page, its cells, and the notebook files."""

    def __init__(self, name, page, opened, cells, saved, committed, seconds, artifacts):
        self.name, self.page, self.cells, self.saved, self.committed = name, page, cells, saved, committed
        self.opened = opened  # the cells as the page showed them when the lesson was opened, before running
        self.seconds, self.artifacts = seconds, artifacts
        self.stem = name.removesuffix(".ipynb")

    def cell(self, i):
        return notebook_panel(self.page).locator(".jp-Notebook .jp-Cell").nth(i)

    def screenshot(self, i, label):
        if not SCREENSHOTS:
            return None
        path = self.artifacts / f"{self.stem}_{label}.png"
        self.cell(i).screenshot(path=str(path))
        return path


@pytest.fixture(scope="module")
def lessons(lab, browser, artifacts):
    """lessons(name) opens the lesson once per module, runs all its cells and caches what it shows."""
    done = {}

    def get(name):
        if name not in done:
            path = NOTEBOOKS / name
            assert path.exists(), f"{path.relative_to(ROOT)} does not exist: the browser test needs it"
            committed = json.loads(path.read_text())
            page = browser.new_page()
            console = []
            page.on("pageerror", lambda exc: console.append(f"page error: {exc}"))
            t0 = time.monotonic()
            where = f"{COPY}/{name}"
            open_notebook(page, lab, where, len(committed["cells"]))
            opened = read_cells(page)
            run_all_cells(page, lab, where)
            seconds = time.monotonic() - t0
            cells = read_cells(page)
            if SCREENSHOTS:
                page.screenshot(path=str(artifacts / f"{name.removesuffix('.ipynb')}_after_run_all.png"))
            saved = save_notebook(page, lab, where)
            (artifacts / f"{name.removesuffix('.ipynb')}_log.txt").write_text(
                f"open + run all cells: {seconds:.1f} s\n" + "\n".join(console) + "\n")
            done[name] = Lesson(name, page, opened, cells, saved, committed, seconds, artifacts)
        return done[name]

    return get


def _tagged(nb):
    return {i for i, c in enumerate(nb["cells"]) if "raises-exception" in c.get("metadata", {}).get("tags", [])}


def _source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@pytest.mark.parametrize("name", LESSONS)
def test_the_learners_copy_opens_with_no_stored_output(lessons, name):
    lesson = lessons(name)
    stored = [i for i, c in enumerate(lesson.committed["cells"]) if c.get("outputs")]
    assert stored, f"notebooks/{name} stores no output: this test could not tell the copy from the original"
    shown = [(i, c["prompt"].strip(), c["output"][:60]) for i, c in enumerate(lesson.opened)
             if c["output"].strip() or c["prompt"].strip() not in ("", "[ ]:")]
    assert not shown, (f"{COPY}/{name} opened showing stored outputs (cell, prompt, output), which answer its "
                       f"'Predict first' questions: {shown}")


@pytest.mark.parametrize("name", LESSONS)
def test_run_all_cells_executes_every_code_cell(lessons, name):
    lesson = lessons(name)
    kinds = ["code" if c["cell_type"] == "code" else "markdown" if c["cell_type"] == "markdown" else "raw"
             for c in lesson.committed["cells"]]
    assert [c["kind"] for c in lesson.cells] == kinds, "the page shows other cells than the notebook file holds"
    saved = lesson.saved["cells"]

    def ran(i, cell):
        if re.fullmatch(r"\[\d+\]:", cell["prompt"].strip()):
            return True
        # a collapsed cell (a reveal cell of the learner's copy) shows no prompt: the saved file has its count
        hidden = saved[i].get("metadata", {}).get("jupyter", {}).get("source_hidden")
        return bool(hidden) and saved[i].get("execution_count") is not None

    not_run = [(i, c["prompt"]) for i, c in enumerate(lesson.cells)
               if c["kind"] == "code" and _source(lesson.committed["cells"][i]).strip() and not ran(i, c)]
    assert not not_run, (f"Run All Cells left these cells of {name} unexecuted (cell index, prompt): {not_run}. "
                         "An error in a cell not tagged raises-exception stops Run All.")


@pytest.mark.parametrize("name", LESSONS)
def test_errors_only_in_cells_tagged_raises_exception(lessons, name):
    lesson = lessons(name)
    # The saved notebook tells error outputs from stderr streams (the page renders both alike).
    errors = {i: [f"{o['ename']}: {o['evalue']}" for o in c.get("outputs", []) if o["output_type"] == "error"]
              for i, c in enumerate(lesson.saved["cells"])}
    errors = {i: e for i, e in errors.items() if e}
    tagged = _tagged(lesson.committed)
    unexpected = {i: e for i, e in errors.items() if i not in tagged}
    assert not unexpected, f"{name}: errors in cells not tagged raises-exception (cell index: error): {unexpected}"
    silent = sorted(tagged - set(errors))
    assert not silent, f"{name}: cells {silent} are tagged raises-exception but raised nothing in the browser"
    for i in sorted(tagged):
        shown = "\n".join(lesson.cells[i]["stderr"])
        ename = errors[i][0].split(":")[0]
        assert ename in shown, f"{name}: cell {i} raised {errors[i][0]} but the page shows no such error: {shown!r}"
        lesson.screenshot(i, f"cell{i:02d}_raises_exception")


@pytest.mark.parametrize("name", LESSONS)
def test_plots_render_as_images(lessons, name):
    lesson = lessons(name)
    with_plots = [i for i, c in enumerate(lesson.committed["cells"])
                  if any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]
    if name == "10_tradeoffs.ipynb":
        assert with_plots, f"{name} stores no plot (image/png output): the lesson should draw its cost model"
    for i in with_plots:
        def images(i=i):
            return read_cells(lesson.page)[i]["images"]

        # A data: URL decodes asynchronously: wait for the <img> to have a size rather than read it once.
        wait_for(lambda: images() and all(img["src"].startswith("data:image/png") and img["width"] > 0
                                          and img["height"] > 0 for img in images()), 30,
                 lambda: f"{name}: cell {i} stores a plot; the page should show it as a decoded PNG <img> after "
                         f"Run All, it shows {[(im['src'][:30], im['width'], im['height']) for im in images()]}")
        lesson.screenshot(i, f"cell{i:02d}_plot")


def test_ddp_cell_shows_rank_prefixed_output(lessons):
    lesson = lessons("00_launcher_tour.ipynb")
    shown = {}
    for i, cell in enumerate(lesson.committed["cells"]):
        if cell["cell_type"] == "code" and _source(cell).lstrip().startswith("%%ddp"):
            ranks = [int(r) for r in RANK_LINE.findall(lesson.cells[i]["output"])]
            if ranks:
                shown[i] = ranks
    assert shown, "00_launcher_tour: no %%ddp cell shows [rank N] lines in the browser"
    four = [i for i, ranks in shown.items() if {0, 3} <= set(ranks)]
    assert four, f"00_launcher_tour: no %%ddp cell shows both [rank 0] and [rank 3] lines; ranks shown: {shown}"
    for i, ranks in shown.items():
        assert ranks == sorted(ranks), f"00_launcher_tour: cell {i}'s lines are not grouped in rank order: {ranks}"
    lesson.screenshot(four[0], f"cell{four[0]:02d}_ddp_ranks")


def _labelled(page, description):
    return page.locator("label.widget-label", has_text=re.compile(rf"^\s*{re.escape(description)}\s*$"))


def _control(lesson, description):
    """The widget whose label reads ``description`` (a slider, a dropdown...)."""
    # the row that holds its label (ipywidgets 8's SelectionSlider row lacks the jupyter-widgets class)
    return lesson.page.locator(".jp-Notebook .widget-inline-hbox").filter(
        has=_labelled(lesson.page, description)).first


def _images(lesson):
    return [img["src"] for c in read_cells(lesson.page) for img in c["images"]]


def _change(control):
    """Move a slider one step with the keyboard (or pick the next dropdown option); returns the new value."""
    handle = control.locator(".noUi-handle")
    if handle.count():
        before = handle.first.get_attribute("aria-valuenow")
        at_max = before == handle.first.get_attribute("aria-valuemax")
        handle.first.focus()
        handle.first.press("ArrowLeft" if at_max else "ArrowRight")
        readout = control.locator(".widget-readout")
        return readout.inner_text() if readout.count() else handle.first.get_attribute("aria-valuenow")
    select = control.locator("select")
    if select.count():
        options = select.locator("option").all()
        values = [o.get_attribute("value") for o in options]
        current = select.input_value()
        new = values[(values.index(current) + 1) % len(values)]
        select.select_option(new)
        return new
    control.locator("input, button").first.click()  # a checkbox or a toggle button
    return "toggled"


def test_controls_redraw_the_cost_model_plot(lessons):
    lesson = lessons("10_tradeoffs.ipynb")
    missing = [d for d in CONTROLS if not _control(lesson, d).count()]
    assert not missing, f"10_tradeoffs shows no widget labelled {missing} after Run All Cells"
    assert _images(lesson), "10_tradeoffs shows no plot (<img>) to redraw"
    cell = next(i for i, c in enumerate(lesson.cells) if c["kind"] == "code"
                and lesson.cell(i).locator(".jupyter-widgets").filter(has=_labelled(lesson.page, CONTROLS[0])).count())
    lesson.screenshot(cell, "widgets_before")
    unchanged = []
    for n, description in enumerate(CONTROLS):
        before = _images(lesson)
        value = _change(_control(lesson, description))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            after = _images(lesson)
            if after and after != before:
                break
            time.sleep(0.2)
        else:
            unchanged.append(f"{description} -> {value}")
        lesson.screenshot(cell, f"widgets_after_{n}_{description.replace(' ', '_')}")
    assert not unchanged, f"10_tradeoffs: moving these controls did not redraw the plot within 30 s: {unchanged}"


# ---- the site's folds, on a probe lesson (docs/conf.py; tests/test_site.py checks the real pages) -----------------

@pytest.fixture(scope="module")
def probe_page(tmp_path_factory):
    """The page of browser_helpers' probe lesson (a markdown and a code reveal cell), built with docs/conf.py."""
    return build_probe_site(tmp_path_factory.mktemp("probe-site"))


class _Folded(HTMLParser):
    """The text of a page, split into what sits inside a closed <details> and what does not."""

    def __init__(self):
        super().__init__()
        self.depth, self.inside, self.outside, self.opened = 0, [], [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "details":
            self.depth += 1
            self.opened += "open" in dict(attrs)

    def handle_endtag(self, tag):
        if tag == "details":
            self.depth -= 1

    def handle_data(self, data):
        (self.inside if self.depth else self.outside).append(data)


def test_the_site_folds_markdown_and_code_reveal_cells(probe_page):
    folded = _Folded()
    folded.feed(probe_page.read_text())
    inside, outside = "".join(folded.inside), "".join(folded.outside)
    for secret in (PROBE_SECRET_MD, PROBE_SECRET_CODE, PROBE_SECRET_OUTPUT, ": a first line with a colon"):
        assert secret in inside and secret not in outside, f"the probe's reveal text {secret!r} is not folded"
    for shown in (PROBE_OPEN, "After the answer: the lesson goes on."):
        assert shown in outside and shown not in inside, f"the probe's ordinary text {shown!r} is folded"
    assert not folded.opened and inside.count("Show the answer") == 2, "two closed folds, each 'Show the answer'"


def test_in_chromium_a_reveal_cell_shows_only_when_clicked(probe_page, browser):
    # the module's one Chromium: a second sync_playwright() inside the first one's event loop is refused
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.goto(probe_page.as_uri(), wait_until="load")
    assert page.get_by_text(PROBE_OPEN).is_visible(), "the probe's question is not shown"
    markdown, code = page.get_by_text(PROBE_SECRET_MD), page.get_by_text(PROBE_SECRET_OUTPUT).last
    assert not markdown.is_visible() and not code.is_visible(), "an answer shows before its fold is opened"
    folds = page.locator("div.cell.tag_reveal details > summary")
    assert folds.count() == 2, f"two folds, found {folds.count()}"
    folds.nth(0).click()
    markdown.wait_for(state="visible", timeout=10_000)
    assert not code.is_visible(), "opening the first fold opened the second"
    folds.nth(1).click()
    code.wait_for(state="visible", timeout=10_000)
    assert page.locator("div.cell.tag_reveal details[open]").count() == 2
    assert not errors, errors
    page.close()


@pytest.mark.parametrize("ci", ["", "true"])
def test_without_chromium_it_says_how_to_leave_the_browser_test_out(monkeypatch, ci):
    """Outside CI a missing browser skips the test, inside CI it fails it; both say how to leave it out."""
    monkeypatch.setenv("CI", ci)
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome) as info:
        _missing("/usr/bin/chromium is not installed")
    assert LEAVE_OUT in str(info.value) and ".ci/install_browser.sh" in str(info.value), str(info.value)


def test_the_way_to_leave_it_out_runs_everything_else():
    import shlex
    import shutil
    import subprocess
    import sys

    for where in ("Makefile", ".ci/install_browser.sh"):
        assert LEAVE_OUT in (ROOT / where).read_text(), f"{where} says the same command"
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    target, variable = shlex.split(LEAVE_OUT)[1:]
    run = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", target, variable],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    (argv,) = [shlex.split(line) for line in run.stdout.splitlines() if "pytest" in line]
    options = argv[argv.index("pytest") + 1:]
    assert options == ["--deselect=tests/test_browser.py"], f"only an option, so pytest keeps its testpaths: {argv}"
    # and the option drops this module and nothing else (collected, not run)
    collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", *options,
                              "tests/test_browser.py", "tests/test_plots.py"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    ids = [line for line in collect.stdout.splitlines() if "::" in line]
    assert ids and all(i.startswith("tests/test_plots.py::") for i in ids), collect.stdout[-2000:]
