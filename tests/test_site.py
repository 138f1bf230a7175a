"""The course read online: `make site` builds the lessons with their stored outputs into a static site.

    .venv/bin/python -m pytest -n 0 tests/test_site.py -p no:randomly

One build serves the whole module (about 20 s on 2 idle cores, 45 s beside other tests; printed, not asserted):
`make site` runs into a temporary folder, exactly the recipe a reader and .github/workflows/pages.yml run, with
warnings as errors. The
checks read its pages: one per lesson and one per docs/*.md page, each lesson with as many output blocks and images
as its notebook stores, launch links to notebooks that exist (Colab and Kaggle only once pyproject.toml names the
course's repository), the course's terms in the search index, no machine's path and no link to an address the course
does not have on any page. The last
ones open the site in headless Chromium (tests/test_browser.py's set-up: Debian's /usr/bin/chromium through
Playwright): the home page and a lesson load with no console error, the lesson shows a stored ``[rank 0]`` output
and its plot, the search box finds a term, lesson 00's first ``reveal`` cell stays folded until it is clicked.
They live in this module so that the one build serves them too (the
root conftest.py keeps a module on one worker).

Without Sphinx (Python 3.10: Sphinx 9 needs 3.11) or Chromium the tests that need them skip, and fail under CI=true.
The stored outputs' scan for absolute paths and the Markdown files' links as a code host shows them need neither.
"""
import html
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from functools import partial
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import LESSONS, ROOT, in_ci

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

BIN = Path(sys.executable).parent
STAMP = ".venv/.installed"  # make -o treats the venv as installed: a test never reinstalls it
# "" until the maintainer sets [project.urls] Repository: then no page may open or install from an address
REPOSITORY = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("urls", {}).get(
    "Repository", "").rstrip("/")
DOCS = sorted(p.relative_to(ROOT).with_suffix("").as_posix() for p in (ROOT / "docs").glob("*.md"))
MARKDOWN = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# The addresses the course was given before it had any (a site and an organisation that do not exist), and the
# launch services that need a real repository: no page, README or lesson may link to them.
PLACEHOLDER = re.compile(r"micro-ddp\.github\.io|github\.com/micro-ddp(?:/|\b)")
LAUNCHERS = re.compile(r"colab\.research\.google\.com|kaggle\.com/kernels")
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# myst-nb's choice among an output's mime types for HTML (its default nb_mime_priority, the types the lessons store)
PRIORITY = [WIDGET_VIEW, "text/html", "image/svg+xml", "image/png", "image/jpeg", "text/markdown", "text/plain"]
TERMS = ["all_reduce", "no_sync", "PowerSGD", "fully_shard"]

# A path that names one machine: a home folder, a folder a tool made in /tmp, a venv or installed package under an
# absolute path, a Windows user folder. Paths every learner shares (/usr/bin/chromium, /dev/shm, ~/.cache/...,
# a relative .venv/bin/python, a command's example --checkpoint-dir /tmp/ft) are not a machine's.
MACHINE_PATH = re.compile(r"""(?x)
      (?<![\w.~/-])/(?:home|Users|root)/[\w.-]+
    | (?<![\w.~/-])/tmp/(?:tmp|pytest-of-|ipykernel_|torchelastic_|pymp-|jupyter)[\w.-]*
    | (?<![\w.~-])/(?:[\w.+-]+/)+\.?venv\w*/
    | (?<![\w.~-])/(?:[\w.+-]+/)+(?:site|dist)-packages/
    | \b[A-Za-z]:\\+(?:Users|Windows)\\+
""")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
BASE64 = re.compile(r'(?<=base64,)[A-Za-z0-9+/=]{64,}|(?<="image/png": ")[A-Za-z0-9+/=\\n]{64,}')


def machine_paths(text):
    """The machine paths in ``text`` (ANSI colours removed: a traceback wraps its paths in them)."""
    text = ANSI.sub("", text)
    found = [m.group(0) for m in MACHINE_PATH.finditer(text)]
    found += [p for p in {str(ROOT), sys.prefix, str(Path.home())} if len(p) > 1 and p in text]
    return found


def _missing(what):
    message = f"{what}: `make test` installs the test extra (Sphinx and myst-nb need Python 3.11+)"
    if in_ci():
        pytest.fail(f"{message}. CI=true, where a skipped site test would hide that the site was never built.")
    pytest.skip(message)


# ---- the stored outputs: no machine's path (no build needed) ------------------------------------------------------

@pytest.mark.parametrize("text, found", [
    ("\x1b[36mFile \x1b[39m\x1b[32m/work/main/.venv/lib/python3.11/site-packages/torch/x.py:83\x1b[39m", True),
    ("File /usr/lib/python3/dist-packages/torch/x.py:83", True),
    ("see /home/alice/micro-ddp/notebooks", True),
    ("saved to /root/.cache/micro-ddp", True),
    ("File /tmp/ipykernel_4242/123.py:3", True),
    ("rootdir: /tmp/pytest-of-bob/pytest-3", True),
    ("C:\\Users\\bob\\micro-ddp", True),
    ("File .../site-packages/torch/distributed/c10d_logger.py:83", False),
    ("/usr/bin/chromium --headless; /dev/shm is 64 MB", False),
    (".venv/bin/python -m pytest; ~/.cache/micro-ddp/bandwidth.json", False),
    ("torchrun ... --checkpoint-dir /tmp/ft --save-every 5", False),
    ("https://github.com/pytorch/pytorch/pull/149869", False),
])
def test_the_machine_path_rule(text, found):
    assert bool(machine_paths(text)) == found, f"{text!r}: {machine_paths(text)}"


def _strings(value):
    """Every string inside a stored output (its text, traceback lines, each mime type's data)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_no_stored_output_holds_a_machine_path():
    """A stored output is published (the site, a code host's viewer): no absolute path of the machine that ran it.
    A traceback shows installed files as .../site-packages/... (nbval does not compare tracebacks)."""
    found = {}
    for path in LESSONS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            for output in cell.get("outputs", []):
                hits = machine_paths("\n".join(_strings(output)))
                if hits:
                    found.setdefault(f"{path.name} cell {i}", set()).update(hits)
    assert not found, (f"stored outputs hold absolute paths of the machine that ran them: {found}. Replace them in the "
                       "stored output ('/.../site-packages/' -> '.../site-packages/'), or print a relative path")


# ---- the build ------------------------------------------------------------------------------------------------------

def _make(*args, timeout=600):
    if shutil.which("make") is None:
        _missing("make is not installed")
    return subprocess.run(["make", "--no-print-directory", "-o", STAMP, f"BIN={BIN}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """`make site` into a temporary folder, once for the module: (the run, the html folder, seconds)."""
    try:
        import myst_nb  # noqa: F401
        import sphinx_book_theme  # noqa: F401
    except ImportError as error:
        _missing(f"the site's packages are not installed ({error})")
    out = tmp_path_factory.mktemp("site") / "html"
    t0 = time.monotonic()
    run = _make("site", f"SITE={out}")
    seconds = time.monotonic() - t0
    print(f"make site: {seconds:.1f} s on {os.cpu_count()} cores, exit code {run.returncode}")
    return run, out, seconds


@pytest.fixture(scope="module")
def built(site):
    run, out, _ = site
    assert run.returncode == 0, "`make site` failed: test_make_site_builds_with_warnings_as_errors shows its output"
    return out


def test_make_site_builds_with_warnings_as_errors(site):
    dry = _make("-n", "site", "SITE=out/html").stdout
    (argv,) = [shlex.split(line) for line in dry.splitlines() if "sphinx" in line]
    for flag in ("-W", "--keep-going", "-n"):
        assert flag in argv, f"make site must run Sphinx with {flag} (warnings are errors, every link resolves): {argv}"
    assert argv[-2:] == [".", "out/html"], f"the source is the repository, the output SITE: {argv}"
    run, _, seconds = site
    assert run.returncode == 0, f"`make site` failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    assert "WARNING" not in run.stderr + run.stdout, run.stderr[-6000:]
    print(f"the site built in {seconds:.1f} s")


def test_one_page_per_lesson_and_the_home_page(built):
    pages = sorted(p.relative_to(built).as_posix() for p in built.rglob("*.html") if "_static" not in p.parts)
    lessons = [f"notebooks/{p.stem}.html" for p in LESSONS]
    docs = [f"{doc}.html" for doc in DOCS]
    assert sorted(set(pages) - {"genindex.html", "search.html"}) == sorted(
        lessons + docs + ["README.html", "index.html", "CONTRIBUTING.html"]), pages
    print(f"{len(pages)} pages: {len(lessons)} lessons, the home page (README.html and index.html), {docs}, "
          "CONTRIBUTING, search, index")
    home = (built / "index.html").read_text()
    assert home == (built / "README.html").read_text(), "index.html is the home page (README.md)"
    for anchor in ("lesson-map", "quick-start"):
        assert f'id="{anchor}"' in home, f"the home page has no #{anchor} section"
    for lesson in lessons + docs:
        assert f'href="{lesson}"' in home, f"the home page does not link {lesson}"


class _Outputs(HTMLParser):
    """The outputs a myst-nb page shows: each ``div.output`` block by kind, each <img> inside a cell's output."""

    def __init__(self):
        super().__init__()
        self.kinds, self.images, self.depth, self.stack = [], 0, 0, []

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div":
            self.stack.append("cell_output" in classes)
            if "output" in classes:
                self.kinds.append(next(c for c in classes if c in ("stream", "stderr", "traceback", "text_plain",
                                                                   "text_html", "text_latex")))
        if tag == "img" and any(self.stack):
            self.images += 1

    def handle_endtag(self, tag):
        if tag == "div" and self.stack:
            self.stack.pop()


def _stored(nb):
    """What a notebook stores, by the kind a page shows: ({kind: count}, [markdown outputs' text])."""
    kinds, markdown = {}, []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            if output["output_type"] == "stream":
                kind = "stream"
            elif output["output_type"] == "error":
                kind = "traceback"
            else:
                mime = next(m for m in PRIORITY if m in output.get("data", {}))
                kind = {"image/png": "image", "image/jpeg": "image", "text/plain": "text_plain",
                        "text/markdown": "markdown", WIDGET_VIEW: "widget"}.get(mime, mime)
                if kind == "markdown":
                    markdown.append("".join(output["data"][mime]))
            kinds[kind] = kinds.get(kind, 0) + 1
    return kinds, markdown


def _text(page):
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem[:2])
def test_each_lesson_page_shows_the_outputs_its_notebook_stores(built, path):
    page = (built / "notebooks" / f"{path.stem}.html").read_text()
    stored, markdown = _stored(json.loads(path.read_text()))
    parser = _Outputs()
    parser.feed(page)
    shown = {}
    for kind in parser.kinds:
        kind = "stream" if kind == "stderr" else kind
        shown[kind] = shown.get(kind, 0) + 1
    if parser.images:
        shown["image"] = parser.images
    widgets = stored.pop("widget", 0)
    expected = {k: v for k, v in stored.items() if k != "markdown"}
    assert shown == expected, f"{path.name}: the page shows {shown} output blocks, the notebook stores {expected}"
    text = " ".join(_text(page).split())
    for md in markdown:
        words = " ".join(re.sub(r"[*_`#|]", " ", md).split()[:8])
        assert " ".join(re.sub(r"[*_`#|]", " ", text).split()).find(words) >= 0, (
            f"{path.name}: a stored markdown output is not on the page: {md[:200]!r}")
    assert WIDGET_VIEW not in page, f"{path.name}: a widget's empty box (its view needs a kernel)"
    if widgets:
        assert text.count("Run the notebook to move the sliders") == widgets, (
            f"{path.name}: each of its {widgets} widget outputs should say to run the notebook to move the sliders")
    images = re.findall(r'<img [^>]*src="([^"]+)"', page)
    missing = [src for src in images if not (built / "notebooks" / src).resolve().is_file()]
    assert not missing, f"{path.name}: images the page shows but the site lacks: {missing}"


def _launch_links(page):
    return dict(re.findall(r'<a class="launch-(colab|kaggle|download)" href="([^"]+)"', page))


def _check_launch_links(name, links, text, repository):
    """What a lesson page offers: Download .ipynb always; Colab, Kaggle and the install cell from ``repository``."""
    if not repository:
        assert set(links) == {"download"}, f"{name}: without a repository, Download .ipynb only: {links}"
        assert "!pip install" not in text, f"{name}: an install cell with no address to install from"
        return
    assert set(links) == {"colab", "kaggle", "download"}, f"{name}: launch links {links}"
    blob = f"{repository.removeprefix('https://github.com/')}/blob/main/"
    for where in ("colab", "kaggle"):
        target = re.search(rf"{re.escape(blob)}(notebooks/\d\d_[\w-]+\.ipynb)$", unquote(links[where]))
        assert target, f"{name}: Open in {where} should open {blob}notebooks/NN_*.ipynb: {links[where]}"
        assert target.group(1) == f"notebooks/{name}", f"{name}: Open in {where} opens {target.group(1)}"
        assert (ROOT / target.group(1)).is_file(), f"{target.group(1)} does not exist"
    assert links["colab"].startswith("https://colab.research.google.com/github/"), links["colab"]
    assert links["kaggle"].startswith("https://kaggle.com/kernels/welcome?src="), links["kaggle"]
    assert f'!pip install -q --no-deps "git+{repository}"' in text, (
        f"{name}: the page should show the Kaggle/Colab first cell that installs the course's package")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem[:2])
def test_each_lesson_has_its_launch_links(built, path):
    page = (built / "notebooks" / f"{path.stem}.html").read_text()
    links = _launch_links(page)
    assert "download" in links, f"{path.name}: no Download .ipynb link: {links}"
    assert (built / "notebooks" / links["download"]).read_bytes() == path.read_bytes(), (
        f"Download .ipynb should give {path.name} as stored")
    _check_launch_links(path.name, links, _text(page), REPOSITORY)


@pytest.mark.parametrize("repository", ["", "https://github.com/example/course"], ids=["unset", "set"])
def test_the_launch_links_follow_the_repository_setting(repository):
    """docs/conf.py's launch cell with pyproject's Repository unset (today) and set: the set case is what a
    published course shows, so it is checked before anyone publishes (the built pages check today's)."""
    try:
        import docutils  # noqa: F401  (docs/conf.py's directive needs it; Sphinx brings it)
    except ImportError:
        _missing("docutils is not installed")
    import importlib.util

    spec = importlib.util.spec_from_file_location("site_conf", ROOT / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    conf.REPOSITORY = repository
    name = LESSONS[0].name
    cell = conf.launch_cell(name)["source"]
    _check_launch_links(name, _launch_links(cell), html.unescape(cell), repository)
    gpus = conf.transform_gpus((ROOT / "docs" / "gpus.md").read_text())
    shown = f'"git+{repository}"' if repository else "git+<this repository's URL>"
    assert shown in gpus, f"docs/gpus.md's first cell on the page should read {shown}"


def _reveal_cells(path):
    return [i for i, c in enumerate(json.loads(path.read_text())["cells"])
            if "reveal" in c.get("metadata", {}).get("tags", [])]


# docs/conf.py folds a reveal cell: its box, then at once myst-nb's closed <details> with the answer's summary
FOLDED = re.compile(r'<div class="cell tag_reveal[^"]*">\s*<details class="admonition hide[^"]*">\s*'
                    r'<summary[^>]*>\s*<p class="collapsed admonition-title">Show the answer</p>')


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem[:2])
def test_each_reveal_cell_is_folded_on_its_page(built, path):
    """Every cell tagged reveal, markdown or code, is a closed fold a reader opens on purpose (tests/test_browser.py
    opens one of a probe lesson in Chromium; the Chromium check below, one of lesson 00)."""
    page = (built / "notebooks" / f"{path.stem}.html").read_text()
    reveal = _reveal_cells(path)
    boxes, folded = page.count('<div class="cell tag_reveal'), len(FOLDED.findall(page))
    assert boxes == folded == len(reveal), (
        f"{path.name}: {len(reveal)} reveal cells ({reveal}), the page has {boxes} reveal boxes, {folded} of them "
        "folded (docs/conf.py's fold_reveal)")
    assert "<details open" not in page, f"{path.name}: a fold opens by itself"


def test_every_link_between_pages_resolves(built):
    """Sphinx's -n checks the references it makes; this checks every relative href and #anchor of every page."""
    broken = []
    for page in built.rglob("*.html"):
        if "_static" in page.relative_to(built).parts:  # the theme's template macros, not pages
            continue
        text = page.read_text()
        for href in set(re.findall(r'href="([^"]+)"', text)):
            parts = urlsplit(html.unescape(href))
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if not target.exists():
                broken.append(f"{page.relative_to(built)} -> {href}")
            elif parts.fragment and target.suffix == ".html" and (
                    f'id="{parts.fragment}"' not in target.read_text()):
                broken.append(f"{page.relative_to(built)} -> {href} (no such anchor)")
    assert not broken, f"links that lead nowhere: {broken[:20]}"


def test_the_search_index_holds_the_course_terms(built):
    from sphinx.search.en import SearchEnglish

    index = (built / "searchindex.js").read_text()
    data = json.loads(index[index.index("(") + 1:index.rindex(")")])
    stem = SearchEnglish({}).stem
    missing = [term for term in TERMS if stem(term.lower()) not in data["terms"]]
    assert not missing, f"the search index lacks {missing}"
    lessons = {name for name in data["docnames"] if name.startswith("notebooks/")}
    assert lessons == {f"notebooks/{p.stem}" for p in LESSONS}, f"lessons the search index covers: {sorted(lessons)}"


def test_no_page_publishes_a_machine_path(built):
    found = {}
    # the pages, their search index and the sources they offer for download (the theme's own files name no machine)
    for page in sorted(built.rglob("*")):
        if (page.suffix in (".html", ".js", ".txt", ".ipynb") and page.is_file()
                and "_static" not in page.relative_to(built).parts):
            raw = BASE64.sub("", page.read_text(errors="replace"))   # images: most of the bytes, never a path
            hits = machine_paths(raw) + machine_paths(_text(raw))
            if hits:
                found[page.relative_to(built).as_posix()] = sorted(set(hits))[:5]
    assert not found, f"pages that publish a machine's path: {found}"


# ---- the site's promises elsewhere: the README and the deploy workflow -----------------------------------------------

def test_the_readme_says_how_to_build_and_open_the_site_locally():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"`make site`.*\s+.*`docs/_build/html/index\.html`", readme), (
        "README: how to build the site locally (`make site`) and what to open (docs/_build/html/index.html)")
    section = re.search(r"^## The site\s*$(.*?)(?=^## )", (ROOT / "CONTRIBUTING.md").read_text(), re.M | re.S)
    assert section and "make site" in section.group(1), "CONTRIBUTING.md: a 'The site' section with `make site`"
    assert "pages.yml" in section.group(1), "CONTRIBUTING.md: the section says which workflow deploys the site"


def _markdown_texts():
    """Every Markdown text a reader sees: README, CONTRIBUTING, docs/*.md and each lesson's markdown cells."""
    for path in MARKDOWN:
        yield path.relative_to(ROOT).as_posix(), path.read_text()
    for path in LESSONS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "markdown":
                yield f"{path.name} cell {i}", "".join(cell["source"])


def test_no_file_links_to_an_address_the_course_does_not_have():
    found = [f"{where}: {m.group(0)}" for where, text in _markdown_texts() for m in PLACEHOLDER.finditer(text)]
    if not REPOSITORY:
        found += [f"{where}: {m.group(0)}" for where, text in _markdown_texts() for m in LAUNCHERS.finditer(text)]
    assert not found, f"links to addresses the course does not have (pyproject.toml's [project.urls]): {found}"


def test_no_page_links_to_an_address_the_course_does_not_have(built):
    found = {}
    for page in sorted(built.rglob("*.html")):
        if "_static" in page.relative_to(built).parts:
            continue
        hrefs = re.findall(r'href="([^"]+)"', page.read_text())
        bad = [h for h in hrefs if PLACEHOLDER.search(h) or (not REPOSITORY and LAUNCHERS.search(h))]
        if bad:
            found[page.relative_to(built).as_posix()] = sorted(set(bad))[:3]
    assert not found, f"pages that link to an address the course does not have: {found}"


def _slug(heading):
    """A heading's anchor as a code host and MyST make it: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_resolves_on_a_code_host():
    """The Markdown files as a code host shows them (no build): each relative link names a file that exists, and
    its #anchor a heading of that file."""
    broken = []
    for path in MARKDOWN:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.name} -> {target}")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+\s+(.+?)\s*$", re.sub(r"```.*?```", "", dest.read_text(), flags=re.S),
                                      re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{path.name} -> {target} (no such heading)")
    assert not broken, f"links that lead nowhere on a code host: {broken}"


def test_the_readme_speaks_to_a_learner_not_of_the_machines_it_was_made_on():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 12_000, f"README.md is {len(readme):,} characters: the learner's page stays under 12,000"
    said = [w for w in ("cannot run here", "these machines", "course's machines", "shared 2-core", "this machine's",
                        "on this laptop") if w in readme]
    assert not said, f"README.md speaks of the machines the course was developed on: {said}"


def test_the_deploy_workflow_runs_make_site_and_publishes_its_folder():
    workflow = (ROOT / ".github" / "workflows" / "pages.yml").read_text()
    assert re.search(r"^\s+run: make site\s*$", workflow, re.M), "pages.yml builds with exactly `make site`"
    default = re.search(r"^SITE \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert re.search(rf"^\s+path: {re.escape(default)}\s*$", workflow, re.M), f"pages.yml publishes {default}"
    assert "python-version: \"3.11\"" in workflow, "pages.yml uses the Python CI and environment.yml use"
    gitignore = (ROOT / ".gitignore").read_text().split()
    assert any(default.startswith(entry.rstrip("/")) for entry in gitignore), f"{default} is git-ignored"


# ---- in Chromium -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(built):
    """The site over http on 127.0.0.1 (as a static host serves it), for the module."""
    handler = partial(_Quiet, directory=str(built))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(served, tmp_path_factory):
    from browser_helpers import CHROMIUM, chromium_context

    if not CHROMIUM.exists():
        _missing(f"{CHROMIUM} is not installed (.ci/install_browser.sh installs it)")
    with chromium_context(tmp_path_factory.mktemp("chromium-profile"), _missing) as context:
        yield context


def _open(browser, url):
    """A page at ``url`` once loaded, and the console errors, page errors and failed requests it had (a request that
    left the machine fails too: the site loads nothing from elsewhere)."""
    page = browser.new_page()
    errors = []
    page.on("console", lambda msg: errors.append(f"console {msg.type}: {msg.text}") if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))
    page.on("requestfailed", lambda req: errors.append(f"request failed: {req.url} ({req.failure})"))
    page.on("response", lambda res: errors.append(f"HTTP {res.status}: {res.url}") if res.status >= 400 else None)
    page.goto(url, wait_until="load")
    page.wait_for_load_state("networkidle")
    page.wait_for_timeout(500)  # a late request (the favicon) reports its 404 after the network is idle
    return page, errors


def test_in_chromium_the_home_page_loads_with_no_console_error(browser, served):
    page, errors = _open(browser, f"{served}/")
    assert not errors, f"the home page: {errors}"
    assert page.locator("h1").first.inner_text().startswith("Micro-DDP"), page.locator("h1").first.inner_text()
    assert page.locator("#lesson-map").is_visible(), "the home page shows the lesson map"
    nav = page.locator("nav a.reference.internal", has_text="launcher tour").count()
    assert nav or page.locator('a[href="notebooks/00_launcher_tour.html"]').count(), "no link to lesson 00"
    page.close()


def test_in_chromium_a_lesson_shows_rank_output_and_its_plot(browser, served):
    page, errors = _open(browser, f"{served}/notebooks/00_launcher_tour.html")
    assert not errors, f"lesson 00: {errors}"
    rank = page.locator("div.cell_output div.output", has_text="[rank 0]").first
    assert rank.is_visible(), "lesson 00 shows no stored [rank 0] output"
    plot = page.locator("div.cell_output img").first
    plot.scroll_into_view_if_needed()
    size = plot.evaluate("img => [img.complete, img.naturalWidth, img.naturalHeight]")
    assert size[0] and size[1] > 100 and size[2] > 100, f"lesson 00's plot did not load as an image: {size}"
    assert page.locator("a.launch-download").is_visible(), "lesson 00 shows no Download .ipynb link"
    for where in ("colab", "kaggle"):  # only once pyproject.toml names the course's repository
        assert page.locator(f"a.launch-{where}").count() == bool(REPOSITORY), f"Open in {where}, with {REPOSITORY!r}"
    page.close()


def test_in_chromium_the_search_box_finds_a_term(browser, served):
    """As a reader searches: the header's search button on the home page, a term, Enter, the results page."""
    page, errors = _open(browser, f"{served}/")
    page.locator("button.search-button__button:visible").first.click()
    box = page.locator('form.bd-search input[name="q"]:visible').first
    box.fill("no_sync")
    box.press("Enter")
    page.wait_for_url("**/search.html?q=no_sync*")
    results = page.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=30_000)
    hrefs = [results.nth(i).get_attribute("href") for i in range(results.count())]
    assert any("06_ddp_accumulation_no_sync" in h for h in hrefs), f"searching no_sync found {hrefs}"
    assert not errors, f"the search page: {errors}"
    page.close()


def test_in_chromium_a_lesson_hides_its_answer_until_the_reader_opens_it(browser, served):
    """Lesson 00's first reveal cell: closed on the page, its text invisible; one click on its summary shows it."""
    lesson = LESSONS[0]
    reveal = _reveal_cells(lesson)
    assert reveal, f"{lesson.name} has no cell tagged reveal: its predictions are answered after the run"
    page, errors = _open(browser, f"{served}/notebooks/{lesson.stem}.html")
    fold = page.locator("div.cell.tag_reveal details").first
    body = fold.locator(":scope > :not(summary)").first
    assert fold.count() and not body.is_visible(), f"{lesson.name}: the first answer shows before a click"
    fold.locator("summary").click()
    body.wait_for(state="visible", timeout=10_000)
    assert fold.get_attribute("open") is not None, "the fold did not open on a click"
    assert not errors, f"{lesson.name}: {errors}"
    page.close()
