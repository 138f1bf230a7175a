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


def execute(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    t0 = time.monotonic()
    client = nbclient.NotebookClient(nb, timeout=1800, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nb.metadata.pop("widgets", None)  # widget state cannot be checked by nbval: never store it
    nbformat.write(nb, path)
    return time.monotonic() - t0


def main(argv):
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"]  # the venv's kernel
    paths = [Path(p) for p in argv] or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for path in paths:
        print(f"{path.name}: {execute(path):.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
