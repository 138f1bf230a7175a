"""Execute notebooks in place, so their stored outputs come from this environment.

    .venv/bin/python scripts/execute_notebooks.py notebooks/03_all_reduce_by_hand.ipynb
    .venv/bin/python scripts/execute_notebooks.py            # every notebook, in lesson order

Cells tagged ``raises-exception`` may raise; any other error stops with the cell's traceback.
nbval (``make test``) then re-runs each notebook and compares its outputs with these.
"""
import os
import sys
import time
from pathlib import Path

import nbclient
import nbformat

ROOT = Path(__file__).resolve().parent.parent


def kernelspec() -> dict:
    """The python3 kernel's own spec, as JupyterLab stores it in a notebook it saves."""
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    return {"display_name": spec.display_name, "language": spec.language, "name": "python3"}


def machine_paths():
    """This machine's absolute folders a traceback or a warning prints, each with what the stored output says
    instead: installed packages as .../site-packages/, the standard library as .../lib/pythonX.Y/, the repository
    as a relative path. The stored outputs are published (the site, a code host's viewer); nbval compares no
    traceback, and a warning's path is printed relative where a lesson prints one."""
    import sysconfig

    paths = sysconfig.get_paths()
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [(paths["purelib"].rstrip("/") + "/", ".../site-packages/"),
            (paths["platlib"].rstrip("/") + "/", ".../site-packages/"),
            (paths["stdlib"].rstrip("/") + "/", f".../lib/{version}/"),
            (str(ROOT) + "/", "")]


def sanitise(nb) -> None:
    """Replace this machine's folders (machine_paths) in every stored output's text."""
    pairs = machine_paths()

    def clean(text):
        for old, new in pairs:
            text = text.replace(old, new)
        return text

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = clean(out["text"])
            if "traceback" in out:
                out["traceback"] = [clean(line) for line in out["traceback"]]
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/") and isinstance(value, str):
                    out["data"][mime] = clean(value)


def drop_blanked_status_lines(nb) -> None:
    """A checker's ``Cluster.run`` that takes over a second shows a live status line and blanks it when it ends
    (course_utils.engine.magic.CallView): nbclient stores the blank line as an output of its own, which a run under
    nbval (no live line there) never makes. Such an output holds nothing: it is not stored."""
    for cell in nb.cells:
        if "outputs" in cell:
            cell["outputs"] = [out for out in cell["outputs"]
                               if not (out.get("output_type") in ("display_data", "update_display_data")
                                       and out.get("data") == {"text/plain": ""})]


def import_torch_seconds() -> float:
    """How long a fresh `python -c "import torch"` takes here, the median of 3: stored with each executed notebook,
    so that tests/test_ci_budget.py compares its cells' times as the reference machine would have taken them
    (scripts/stored_outputs.py, REFERENCE_IMPORT_TORCH_S)."""
    import statistics
    import subprocess

    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        runs.append(time.perf_counter() - t0)
    return round(statistics.median(runs), 2)


def execute(path: Path) -> float:
    speed = import_torch_seconds()
    nb = nbformat.read(path, as_version=4)
    t0 = time.monotonic()
    client = nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    sanitise(nb)  # no stored output publishes this machine's folders (tests/test_site.py checks)
    drop_blanked_status_lines(nb)
    nb.metadata.pop("widgets", None)  # widget state cannot be checked by nbval: never store it
    nb.metadata.kernelspec = kernelspec()  # what JupyterLab writes: otherwise an untouched lesson opens "unsaved"
    nb.metadata["micro_ddp"] = {"import_torch_s": speed}  # this machine's speed, beside the times it recorded
    nbformat.write(nb, path)
    return time.monotonic() - t0


def main(argv):
    if any(a.startswith("-") for a in argv):
        print(__doc__.strip())
        return 0 if set(argv) <= {"-h", "--help"} else 2
    missing = [p for p in argv if not Path(p).is_file()]
    if missing:
        print(f"execute_notebooks: no such notebook: {missing[0]} (give paths such as notebooks/00_x.ipynb)",
              file=sys.stderr)
        return 2
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]  # the venv's kernel
    paths = [Path(p) for p in argv] or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path):.1f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
