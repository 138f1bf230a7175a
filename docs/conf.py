"""Sphinx configuration of the course's site: the lessons with their stored outputs, read online.

    make site          # builds docs/_build/html/ (git-ignored), about 20 s on 2 cores

`make site` runs ``sphinx-build -W --keep-going -n -c docs . docs/_build/html``: the source directory is the repository
itself, so README.md is the home page and every link the lessons hold (``../README.md#lesson-map``, the next
lesson's ``NN_topic.ipynb``) resolves as it does on a code host. Only README.md, CONTRIBUTING.md, docs/*.md
(the engine, GPUs, multi-node) and notebooks/NN_*.ipynb are read; the notebooks are never executed
(``nb_execution_mode = "off"``): a page shows what nbval checks.

Four things change on the way into the page, at build time (``source-read``), never in the files:
- each lesson gets its launch links after its title: Download .ipynb and, only once ``[project.urls] Repository``
  in pyproject.toml holds the course's real address (the one setting; absent until then), Open in Colab, Open in
  Kaggle and docs/gpus.md's Kaggle/Colab first cell that installs the course's package from that address;
- a widget output (10's cost-model sliders) needs a running kernel: the page says so instead of an empty box;
- every cell tagged ``reveal`` (the answer to a prediction, right after its run: CONTRIBUTING.md, "The learner does
  the work") is folded, so a reader opens it on purpose: a code cell gets myst-nb's ``hide-cell`` tag (source and
  outputs in one ``<details>``), a markdown cell, which myst-nb renders without reading its tags, goes inside the
  ``course-reveal`` directive below (the same ``<details>``, myst-nb's own node and style);
- README.md gets the site's hidden table of contents (the sidebar), and docs/gpus.md's first cell for Colab/Kaggle
  is shown as plain text (a ``!pip`` line is neither Python nor, with its comment, shell), with the repository's
  address in place of ``<this repository's URL>`` once there is one.
tests/test_site.py builds the site into a temporary folder and checks the pages; .github/workflows/pages.yml
publishes what `make site` builds.
"""
import json
import re
import shutil
from pathlib import Path
from urllib.parse import quote

from docutils import nodes
from docutils.parsers.rst import Directive

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (Sphinx 9 itself needs 3.11: pyproject's test extra says so)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# "" until the maintainer sets it: then no page links to an address the course does not have (tests/test_site.py)
REPOSITORY = PYPROJECT["project"].get("urls", {}).get("Repository", "").rstrip("/")
GPUS = ROOT / "docs" / "gpus.md"  # the Kaggle/Colab first cell's one home (read from this checkout, not a probe's)
BRANCH = "main"  # the branch the launch links open (the one .github/workflows/pages.yml publishes from)
LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
REVEAL = "reveal"                            # the tag of a cell that answers a prediction
SHOW, HIDE = "Show the answer", "Hide the answer"   # the fold's summary, closed and open (tests/test_site.py)

project = "Micro-DDP"
author = "the Micro-DDP course"
copyright = "the Micro-DDP course"

extensions = ["myst_nb"]
root_doc = "README"
include_patterns = ["README.md", "CONTRIBUTING.md", "docs/*.md", "notebooks/[0-9][0-9]_*.ipynb"]
# Sphinx walks the source directory before it filters: everything else at the top (.venv above all) is pruned.
exclude_patterns = sorted(p.name for p in ROOT.iterdir()
                          if p.name not in {"README.md", "CONTRIBUTING.md", "docs", "notebooks"})
exclude_patterns += ["notebooks/.ipynb_checkpoints", "docs/_build", "docs/_static"]

nb_execution_mode = "off"        # the stored outputs, as nbval checks them; nothing is run
nb_merge_streams = False         # one block per stored output (tests/test_site.py counts them)
nb_output_stderr = "show"        # the [rank N] lines some cells print on stderr are part of the lesson
nb_render_error_lexer = "myst-ansi"  # a stored traceback is ANSI-coloured text (the ipythontb lexer chokes on it)
myst_heading_anchors = 4         # ../README.md#lesson-map, ../docs/gpus.md#kaggle-2-x-t4-and-colab
myst_enable_extensions = ["dollarmath"]
suppress_warnings = []

html_theme = "sphinx_book_theme"
html_title = "Micro-DDP: data-parallel training, one notebook cell at a time"
html_static_path = ["_static"]
html_css_files = ["launch.css"]
html_favicon = "_static/favicon.svg"  # without one a browser asks for /favicon.ico and logs the 404 as a console error
html_last_updated_fmt = None
# the reader's light or dark mode; without a default a first visit logs "Got invalid theme mode" as a console error
html_context = {"default_mode": "auto"}
html_theme_options = {
    "repository_url": REPOSITORY,
    "repository_branch": BRANCH,
    "use_repository_button": bool(REPOSITORY),
    "use_download_button": True,
    "home_page_in_toc": True,
    "show_toc_level": 2,
    # the theme's own launch buttons know Colab but not Kaggle: the lesson pages carry their own (below)
    "launch_buttons": {},
}


def lesson_links(name):
    """The launch links of one lesson (notebooks/NN_topic.ipynb): Colab, Kaggle and the .ipynb next to the page."""
    blob = f"{REPOSITORY}/blob/{BRANCH}/notebooks/{name}"
    github = re.match(r"https://github\.com/(.+)$", REPOSITORY)
    colab = (f"https://colab.research.google.com/github/{github.group(1)}/blob/{BRANCH}/notebooks/{name}" if github
             else f"https://colab.research.google.com/#fileId={quote(blob, safe='')}")
    kaggle = f"https://kaggle.com/kernels/welcome?src={quote(blob, safe=':/')}"
    return {"colab": colab, "kaggle": kaggle, "download": name}


def first_cell():
    """docs/gpus.md's Kaggle/Colab first cell, with the repository's URL in place of its placeholder."""
    text = GPUS.read_text()
    section = text[text.index("## Kaggle"):]
    start = section.index("```python")
    block = section[start:section.index("```", start + 3) + 3]
    lines = [line.strip() for line in block.splitlines()]
    return "\n".join(lines).replace("<this repository's URL>", REPOSITORY).replace("```python", "```text")


def launch_cell(name):
    if not REPOSITORY:  # no address to open or install from: the notebook itself, and how to run it here
        text = (f'<p class="launch-links"><a class="launch-download" href="{name}" download>Download .ipynb</a></p>'
                "\n\nThis page shows the lesson with the outputs it stores (checked in CI); run it to make them yours: "
                "`make lab` installs the course's package `course_utils` and opens the lessons in JupyterLab.\n")
        return {"cell_type": "markdown", "id": "site-launch-links", "metadata": {}, "source": text}
    links = lesson_links(name)
    text = (
        '<p class="launch-links">'
        f'<a class="launch-colab" href="{links["colab"]}">Open in Colab</a> '
        f'<a class="launch-kaggle" href="{links["kaggle"]}">Open in Kaggle</a> '
        f'<a class="launch-download" href="{links["download"]}" download>Download .ipynb</a>'
        "</p>\n\n"
        "This page shows the lesson with the outputs it stores (checked in CI); run it to make them yours. The lesson "
        "needs the course's package `course_utils`: locally `make lab` installs it; on Colab or Kaggle, run this "
        "first cell before the lesson's setup cell ([Kaggle (2 x T4) and "
        "Colab](../docs/gpus.md#kaggle-2-x-t4-and-colab) says which accelerator to choose):\n\n" + first_cell() + "\n")
    return {"cell_type": "markdown", "id": "site-launch-links", "metadata": {}, "source": text}


def widget_note(output):
    shown = "".join(output["data"].get("text/plain", ""))
    what = re.search(r"\(([^()]*)\)", shown)
    return ("*Run the notebook to move the sliders: this cell shows an interactive widget"
            + (f" ({what.group(1)})" if what else "") + ", which only a running kernel can draw.*")


def fold_reveal(cell):
    """A ``reveal`` cell, folded on the page: myst-nb's hide-cell for code, the course-reveal directive for markdown."""
    if cell["cell_type"] == "code":
        # reveal first: the page's box is then "cell tag_reveal ...", whatever order the file lists the tags in
        others = [tag for tag in cell["metadata"]["tags"] if tag != REVEAL]
        cell["metadata"]["tags"] = [REVEAL, *others, "hide-cell"]
        cell["metadata"]["mystnb"] = {**cell["metadata"].get("mystnb", {}), "code_prompt_show": SHOW,
                                      "code_prompt_hide": HIDE}
    elif cell["cell_type"] == "markdown":
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", source)), default=0))
        # the directive takes no option: MyST reads no options block, and a first line starting with ":" stays text
        cell["source"] = f"{fence}{{course-reveal}}\n{source}\n{fence}\n"


class RevealDirective(Directive):
    """The folded box of a markdown ``reveal`` cell: myst-nb's ``<details>`` of a hide-cell code cell (its node, so
    its style and its "Show the answer" summary), around the cell's markdown. A heading cannot sit inside it
    (tests/test_predictions.py keeps headings out of reveal cells)."""

    has_content = True

    def run(self):
        from myst_nb.sphinx_ import HideCodeCellNode

        fold = HideCodeCellNode(prompt_show=SHOW, prompt_hide=HIDE)
        fold["classes"] += ["above-input", "reveal-markdown"]
        self.state.nested_parse(self.content, self.content_offset, fold)
        box = nodes.container(classes=["cell", f"tag_{REVEAL}"])  # myst-nb's style for div.cell details.hide
        box += fold
        return [box]


def transform_lesson(name, text):
    nb = json.loads(text)
    for cell in nb["cells"]:
        if REVEAL in cell.get("metadata", {}).get("tags", []):
            fold_reveal(cell)
        for output in cell.get("outputs", []):
            if WIDGET_VIEW in output.get("data", {}):
                output["data"] = {"text/markdown": widget_note(output)}
    title = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown")
    nb["cells"].insert(title + 1, launch_cell(name))
    return json.dumps(nb)


def shell_escapes_as_text(text):
    """A ```python block of ``!pip`` lines shown as text: no lexer reads shell escapes and comments."""
    return re.sub(r"```python(\n\s*!)", r"```text\1", text)


DOCS = ["engine", "gpus", "multi-node"]  # docs/*.md in the sidebar's order, those the source folder holds


def transform_readme(text):
    lessons = "\n".join(f"notebooks/{name.removesuffix('.ipynb')}" for name in LESSONS)
    pages = "\n".join([f"docs/{doc}" for doc in DOCS if (ROOT / "docs" / f"{doc}.md").is_file()] + ["CONTRIBUTING"])
    return (shell_escapes_as_text(text) + "\n\n```{toctree}\n:hidden:\n:caption: Lessons\n\n" + lessons + "\n```\n\n"
            "```{toctree}\n:hidden:\n:caption: The course\n\n" + pages + "\n```\n")


def transform_gpus(text):
    text = shell_escapes_as_text(text)
    return text.replace("<this repository's URL>", REPOSITORY) if REPOSITORY else text


def on_source_read(app, docname, source):
    if docname == "README":
        source[0] = transform_readme(source[0])
    elif docname == "docs/gpus":
        source[0] = transform_gpus(source[0])
    elif docname.startswith("notebooks/"):
        source[0] = transform_lesson(docname.split("/", 1)[1] + ".ipynb", source[0])


def on_build_finished(app, exception):
    """The home page at index.html too (what a static host serves for /), and each lesson's .ipynb beside its page
    (the Download .ipynb link), as stored in the repository."""
    if exception is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    shutil.copyfile(out / "README.html", out / "index.html")
    for name in LESSONS:
        shutil.copyfile(ROOT / "notebooks" / name, out / "notebooks" / name)


def setup(app):
    app.add_directive("course-reveal", RevealDirective)
    app.connect("source-read", on_source_read)
    app.connect("build-finished", on_build_finished)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
