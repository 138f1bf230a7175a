"""Promises of docs/engine.md (the engine's specification) and docs/gpus.md (the Kaggle/Colab first cell) that no
other test checks: each test below fails on an engine, or an install cell, that breaks the promise named in its name.

%unload_ext starting a new server and multiprocessing finding cell-defined objects are tested in
test_engine_leaks.py, with the engine changes that made them true.
"""
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import ROOT, in_ci
from course_utils import Cluster
from course_utils.engine import _forkstart

CHILD_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTEST_CURRENT_TEST", "COURSE_UTILS_START")}
CHILD_ENV["PYTHONPATH"] = str(ROOT)


# -- "Native Windows is not supported ...: `Cluster` says so at once." ----------------------------------------------
def test_native_windows_stops_at_once_with_what_to_do(monkeypatch):
    from course_utils.engine import launcher

    def no_ranks_on_windows(*args, **kwargs):
        raise AssertionError("the engine tried to start ranks on native Windows")

    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(launcher, "_spawn", no_ranks_on_windows)
    with pytest.raises(RuntimeError, match=r"native Windows is not supported.*WSL 2"):
        Cluster(world_size=2, backend="gloo")


# -- "if it dies anyway, the next start makes a new one, once, before falling back" --------------------------------
# A server that dies (killed between cells, or while it forks a rank) fails the next fork request: the engine
# starts a new one, once; the next death falls back to fresh interpreters. (B, the second server, is left out here:
# when it dies, A serves, as tests/test_engine_faults.py checks.)
SECOND_DEATH = textwrap.dedent("""
    import os, signal
    from course_utils import Cluster
    from course_utils.engine import _forkstart
    # who started the rank: a fork server, or this process itself (a fresh interpreter)
    WHERE = "import os\\n'this process' if os.getppid() == %d else 'a fork server'" % os.getpid()
    _forkstart.start_second_server = lambda: None
    ask, dies = _forkstart.Server.ask, []

    def dying_while_it_forks(server, message, *args, **kwargs):  # as if the server crashed forking the rank
        if dies and message.get("op") == "fork":
            dies.pop()
            os.kill(server.pid, signal.SIGKILL)
            while open(f"/proc/{server.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                pass  # dead, not reaped yet: the engine reaps its own server
            raise ConnectionRefusedError("the fork server died while forking a rank")
        return ask(server, message, *args, **kwargs)

    _forkstart.Server.ask = dying_while_it_forks
    with Cluster(world_size=2, backend="gloo") as c:
        print("first", c.run(WHERE))
    first = _forkstart._state["ctx"].pid
    dies.append(1)
    with Cluster(world_size=2, backend="gloo") as c:
        print("after one death", c.run(WHERE))
    print("a new server", _forkstart._state["ctx"].pid not in (None, first), flush=True)
    dies.append(1)
    with Cluster(world_size=2, backend="gloo") as c:
        print("after two deaths", c.run(WHERE))
    with Cluster(world_size=1, backend="gloo") as c:  # the next start: fresh again, and no second note
        print("and after", c.run(WHERE))
""")


def test_a_second_server_death_falls_back_to_fresh_interpreters_with_one_note():
    if not _forkstart.wanted() or not os.path.isdir("/proc/self"):
        pytest.skip("the ranks start as fresh interpreters here (COURSE_UTILS_START=spawn), or no /proc")
    proc = subprocess.run([sys.executable, "-c", SECOND_DEATH], capture_output=True, text=True, timeout=300,
                          env=CHILD_ENV, cwd=ROOT, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    forked, fresh = "['a fork server', 'a fork server']", "['this process', 'this process']"
    assert proc.stdout.splitlines() == [f"first {forked}", f"after one death {forked}", "a new server True",
                                        f"after two deaths {fresh}", "and after ['this process']"], proc.stdout
    assert proc.stderr.count("note: the ranks start as fresh interpreters") == 1, proc.stderr[-3000:]
    assert "died while forking a rank" in proc.stderr, "the note says why"


# -- "Python's `random` reseeds itself at a fork", "so ranks and restarts never share one": checked with torch's and
# numpy's generators by test_engine_faults.py::test_every_rank_and_every_restart_draws_its_own_random_state


# -- "numpy's BLAS pools sized by threadpoolctl (... else the rank's share)" ------------------------------------------
def test_blas_pools_are_sized_to_the_ranks_share_by_default(monkeypatch):
    """1 rank gets every core (2 on CI's 2 cores) and 2 ranks half each: an engine that always sizes the pools to
    1 thread fails the first; one that leaves them unsized (every core, or 1 if the server was started with
    OPENBLAS_NUM_THREADS=1) fails one of the two."""
    from course_utils.engine.launcher import _cpu_count

    cores = _cpu_count()
    if cores < 2:
        message = "one core: 1 thread is every rank's share, so sizing cannot be told from a fixed 1"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    for world_size in (1, 2):
        with Cluster(world_size=world_size, backend="gloo", timeout=60) as c:
            got = c.run("import numpy\nfrom threadpoolctl import threadpool_info\n"
                        "sorted({p['num_threads'] for p in threadpool_info() if p['internal_api'] == 'openblas'})")
        if not got[0]:
            pytest.skip("threadpoolctl finds no OpenBLAS in the ranks (numpy built against another BLAS)")
        share = cores // world_size
        assert got == [[share]] * world_size, \
            f"{world_size} rank(s) on {cores} cores: each rank's OpenBLAS should run its share ({share}): {got}"


# -- "the backend's own timeout stays far above the cell's (at least 30 minutes)" --------------------------------------
@pytest.mark.parametrize("cell_timeout, want_s", [(5, 1800), (1000, 4000), (float("inf"), 1800)])
def test_the_backends_timeout_is_at_least_30_minutes_and_above_the_cells(make_cluster, cell_timeout, want_s):
    c = make_cluster(2, timeout=cell_timeout)
    got = c.run("import torch, torch.distributed as dist\n"
                "dist.group.WORLD._get_backend(torch.device('cpu')).options._timeout.total_seconds()")
    assert got == [want_s, want_s], f"the gloo group's timeout for a {cell_timeout} s cell: {got}"


# -- "The notebook process never initialises CUDA itself (it counts GPUs through NVML)" -------------------------------
CUDA_SPY = """
import torch, torch.cuda
CUDA_CALLS = []

def _spy(name, f):
    def called(*args, **kwargs):
        CUDA_CALLS.append(name)
        return f(*args, **kwargs)
    return called

for _name in ("_lazy_init", "init", "is_available", "device_count", "current_device", "set_device",
              "synchronize", "get_device_name", "get_device_properties", "mem_get_info"):
    setattr(torch.cuda, _name, _spy(_name, getattr(torch.cuda, _name)))
if not torch.version.cuda:  # a CPU build: fake a CUDA build with one GPU, as far as the engine can tell
    torch.version.cuda = "12.8"
    torch.cuda._device_count_nvml = lambda: 1
"""


def test_the_notebook_process_never_initialises_cuda_through_a_lesson():
    """Lesson 00 (every %%ddp cell, spawn, launch, the checkers) in a kernel that sees a GPU: the kernel never asks
    CUDA anything (a CUDA build would initialise it, and a fork of the notebook after that breaks) and
    torch.cuda.is_initialized() stays false."""
    import nbformat

    from conftest import NOTEBOOKS
    from engine_helpers import Kernel

    cells = [c for c in nbformat.read(NOTEBOOKS / "00_launcher_tour.ipynb", 4).cells if c.cell_type == "code"]
    k = Kernel()
    try:
        assert k.execute(CUDA_SPY)[0] == "ok"
        ran, failed = 0, []
        for i, cell in enumerate(cells):
            status, out, ename = k.execute(cell.source, timeout=300)
            expected = "raises-exception" in cell.metadata.get("tags", [])
            if (status == "ok") == expected:
                failed.append((i, ename, out[-500:]))
            ran += cell.source.startswith("%%ddp")
        status, out, _ = k.execute("print(sorted(set(CUDA_CALLS)), torch.cuda.is_initialized())")
    finally:
        k.close()
    assert ran >= 10 and not failed, f"lesson 00 did not run as stored with one GPU visible: {failed}"
    assert (status, out) == ("ok", "[] False\n"), f"the notebook process asked CUDA: {out}"


# -- docs/gpus.md, Kaggle/Colab: "run this first cell, before the lesson's setup cell" ---------------------------------
START_THE_COURSE = """
import sys
from IPython.core.interactiveshell import InteractiveShell

import course_utils
from course_utils.engine.env import check_environment

print("installed at", course_utils.__file__)
print("environment", check_environment())
shell = InteractiveShell.instance()
for cell in ("%load_ext course_utils", "%%ddp -n 2 --backend gloo\\nimport torch\\nprint(torch.ones(1) * rank)",
             "%ddp shutdown"):
    if not shell.run_cell(cell).success:
        sys.exit(f"the cell failed: {cell!r}")
"""


def test_the_kaggle_and_colab_first_cell_installs_a_course_that_starts(tmp_path):
    """docs/gpus.md's first cell, line by line, in a fresh venv that already has torch (the platform's), with
    this repository's clone for its URL: no index is asked (PIP_NO_INDEX), and nothing but the course is
    installed."""

    gpus = (ROOT / "docs" / "gpus.md").read_text()
    section = gpus[gpus.index("## Kaggle"):]
    block = section[section.index("```python"):section.index("```", section.index("```python") + 3)]
    lines = [line.split("#")[0].strip() for line in block.splitlines() if line.strip().startswith("!pip")]
    assert len(lines) == 2 and "--no-deps" in lines[0], lines
    # Every process below (git, venv, pip, the build, the course and its IPython shell) gets a temporary HOME, XDG,
    # cache and IPython/Jupyter/matplotlib folders, and pip its own TMPDIR: nothing is written outside tmp_path (a
    # rustup proxy on PATH writes ~/.rustup/settings.toml during the build unless RUSTUP_HOME and CARGO_HOME move it)
    home = tmp_path / "home"
    private = {"HOME": home, "XDG_CACHE_HOME": home / ".cache", "XDG_CONFIG_HOME": home / ".config",
               "XDG_DATA_HOME": home / ".local" / "share", "XDG_STATE_HOME": home / ".local" / "state",
               "PIP_CACHE_DIR": home / ".cache" / "pip", "RUSTUP_HOME": home / ".rustup", "CARGO_HOME": home / ".cargo",
               "IPYTHONDIR": home / ".ipython", "MPLCONFIGDIR": home / ".config" / "matplotlib",
               "JUPYTER_CONFIG_DIR": home / ".jupyter", "JUPYTER_DATA_DIR": home / ".local" / "share" / "jupyter",
               "JUPYTER_RUNTIME_DIR": home / ".local" / "share" / "jupyter" / "runtime"}
    for folder in private.values():
        folder.mkdir(parents=True, exist_ok=True)
    private = {k: str(v) for k, v in private.items()}
    private_env = dict(os.environ, **private, GIT_CONFIG_NOSYSTEM="1")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120, env=private_env)
    venv = tmp_path / "venv"
    # no pip or setuptools of its own: the .pth below brings this environment's (the build runs without
    # isolation, which would download setuptools)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300,
                   env=private_env)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True, env=private_env).stdout.strip()
    ours = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(os.path.join(p, "torch"))]
    (Path(site) / "platform_torch.pth").write_text(ours[0] + "\n")  # the platform's torch, numpy, Jupyter
    env = dict(CHILD_ENV, **private, GIT_CONFIG_NOSYSTEM="1", PIP_NO_INDEX="1", PIP_NO_BUILD_ISOLATION="0",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONPATH")
    pip_tmp = tmp_path / "tmp"  # pip's build folders (not the course's: its fork server's socket path stays short)
    pip_tmp.mkdir()
    for line in lines:
        args = shlex.split(line[1:].replace("git+<this repository's URL>", f"git+file://{clone}"))
        assert args[:2] == ["pip", "install"], line
        run = subprocess.run([str(python), "-m", *args], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env=dict(env, TMPDIR=str(pip_tmp)))
        assert run.returncode == 0, f"{line}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    run = subprocess.run([str(python), "-c", START_THE_COURSE], capture_output=True, text=True, env=env,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"installed at {site}" in run.stdout, run.stdout
    assert "environment True" in run.stdout and "[rank 1] tensor([1.])" in run.stdout, run.stdout
