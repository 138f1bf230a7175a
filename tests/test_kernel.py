"""The %%ddp magic in a real IPython kernel, driven through jupyter_client as JupyterLab drives it:
the stop button (SIGINT to the kernel), and a kernel that dies must not leave workers behind.

Backend-aware: the kernel's ``%%ddp -n 2`` picks NCCL on a machine with 2 or more GPUs, so what
the tests expect (the backend named by ``%ddp status``, which ``--backend nccl`` is a bad option) comes from
``choose_backend`` and the GPU count of this machine, not from an assumption of gloo."""
import os
import signal
import time

import pytest

from conftest import alive as _alive
from course_utils import choose_backend
from course_utils.engine.launcher import _gpu_count
from engine_helpers import Kernel


@pytest.fixture
def kernel():
    k = Kernel()
    yield k
    k.close()


def test_magic_runs_on_every_rank_and_shows_rank_prefixed_output(kernel):
    assert kernel.execute("%load_ext course_utils")[0] == "ok"
    status, out, _ = kernel.execute("%%ddp -n 2\nimport torch\nprint('hello from', rank)\ntorch.ones(1) * rank")
    assert status == "ok"
    assert out == "[rank 0] hello from 0\n[rank 1] hello from 1\n[rank 0] tensor([0.])\n[rank 1] tensor([1.])\n", out
    status, out, _ = kernel.execute("%%ddp --rank 1\nprint('only', rank)\nrank")
    assert out == "[rank 1] only 1\n[rank 1] 1\n", out
    status, out, _ = kernel.execute("%ddp pull rank")
    assert out == "[rank 0] 0\n[rank 1] 1\n"
    kernel.execute("shared = {'lr': 0.1}")
    kernel.execute("%ddp push shared")
    assert kernel.execute("%%ddp\nshared['lr'] * (rank + 1)")[1] == "[rank 0] 0.1\n[rank 1] 0.2\n"
    status, _, ename = kernel.execute("%%ddp\nif rank == 1:\n    undefined_name")
    assert (status, ename) == ("error", "DistributedError")
    kernel.execute("%%ddp\nbefore_bad_options = rank + 10")
    pids = kernel.worker_pids()
    for bad in ("--bogus 1", "-n four", "-n 0", "--rank 9", "--timeout -1", _too_few_gpus_for_nccl()):
        status, out, ename = kernel.execute(f"%%ddp {bad}\n1")
        assert status == "error", bad
        assert "UsageError: %%ddp" in out and ename != "ValueError", (bad, ename, out)  # IPython prints UsageErrors
    assert kernel.worker_pids() == pids, "a bad option must not touch the ranks"
    assert kernel.execute("%ddp pull before_bad_options")[1] == "[rank 0] 10\n[rank 1] 11\n"
    status, out, _ = kernel.execute("%%ddp -n 3  # a comment after the options is fine\nrank")
    assert out == ("(started 3 fresh ranks: the names defined on the previous 2 are gone)\n"
                   "[rank 0] 0\n[rank 1] 1\n[rank 2] 2\n"), out
    status, out, _ = kernel.execute("%%ddp --backend gloo\nworld_size")  # a new backend keeps the size
    assert out.endswith("[rank 0] 3\n[rank 1] 3\n[rank 2] 3\n"), out


def test_stop_button_interrupts_the_cell_and_the_next_cell_works(kernel, tmp_path):
    kernel.execute("%load_ext course_utils")
    assert kernel.execute("%%ddp -n 2\nkept = 7")[0] == "ok"
    started = tmp_path / "started"
    msg_id = kernel.kc.execute(f"%%ddp\nimport time\nopen({str(started)!r}, 'w').close()\nwhile True:\n"
                               "    time.sleep(0.01)")
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:  # the loop runs on the ranks now
        time.sleep(0.05)
    if not started.exists():  # the cell never reached its loop: show what the kernel said instead
        said = []
        while True:
            try:
                msg = kernel.kc.get_iopub_msg(timeout=1)
            except Exception:
                break
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] in ("stream", "error"):
                said.append(msg["content"].get("text") or "\n".join(msg["content"].get("traceback", [])))
        pytest.fail("the cell's loop did not start on the ranks within 60 s; the kernel said:\n" + "".join(said))
    t0 = time.monotonic()
    kernel.km.interrupt_kernel()
    ename = None
    while True:
        msg = kernel.kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            ename = msg["content"]["ename"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    kernel.reply(msg_id)
    assert ename == "DistributedInterrupt", "a KeyboardInterrupt that says where each rank was"
    assert time.monotonic() - t0 < 30, "the stop button must stop the cell within seconds (5 s on a quiet machine)"
    status, out, _ = kernel.execute("%%ddp\nrank, kept")
    assert (status, out) == ("ok", "[rank 0] (0, 7)\n[rank 1] (1, 7)\n"), "the ranks were released: names kept"


def test_the_kernel_never_reads_or_writes_the_learners_ipython_or_jupyter_folders(tmp_path, monkeypatch):
    learner = tmp_path / "learner"  # as if it were the learner's HOME, with a startup file and an IPython folder
    startup = learner / ".ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-learner.py").write_text("LEARNERS_STARTUP_RAN = True\n")
    for var, value in (("HOME", learner), ("IPYTHONDIR", learner / ".ipython"),
                       ("JUPYTER_RUNTIME_DIR", learner / "runtime"), ("JUPYTER_DATA_DIR", learner / "data")):
        monkeypatch.setenv(var, str(value))
    before = sorted(p.relative_to(learner) for p in learner.rglob("*"))
    k = Kernel()
    try:
        status, out, _ = k.execute("import os\nip = get_ipython()\n"
                                   "print('LEARNERS_STARTUP_RAN' in globals(), ip.profile_dir.location.startswith("
                                   f"{str(learner)!r}), os.path.expanduser('~').startswith({str(learner)!r}))")
        assert (status, out) == ("ok", "False False False\n"), out
        assert k.execute("%load_ext course_utils")[0] == "ok"
        assert k.execute("%%ddp -n 2\nrank")[0] == "ok"
        home = k.home
    finally:
        k.close()
    assert sorted(p.relative_to(learner) for p in learner.rglob("*")) == before, "the kernel wrote there"
    assert not os.path.exists(home), "the kernel's own folder (history, connection file) is removed"


def _too_few_gpus_for_nccl(ranks=2):
    """A %%ddp option line that asks NCCL for more ranks than this machine has GPUs: a usage error anywhere."""
    gpus = _gpu_count()
    return "--backend nccl" if gpus < ranks else f"-n {gpus + 1} --backend nccl"


def test_the_nccl_option_is_checked_against_this_machines_gpus():
    line = _too_few_gpus_for_nccl()
    n = int(line.split()[1]) if line.startswith("-n") else 2
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        choose_backend("nccl", n)


@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_kernel_end_leaves_no_worker(kernel, how, tmp_path):
    """The ranks end with the kernel, however it ends, and as a script would: a file a cell left open for writing
    keeps what was written (the kernel's exit killed the ranks, the rank that read EOF left with os._exit)."""
    kernel.execute("%load_ext course_utils")
    assert kernel.execute("%%ddp -n 2\nrank")[0] == "ok"
    unclosed = f"log = open({str(tmp_path)!r} + f'/rank{{rank}}.txt', 'w')\nlog.write('kept')"
    assert kernel.execute("%%ddp\n" + unclosed)[0] == "ok"
    pids = kernel.worker_pids()
    assert all(_alive(p) for p in pids)
    if how == "shutdown":
        kernel.km.shutdown_kernel(now=False)
    elif how == "restart":
        kernel.km.restart_kernel(now=True)
    else:
        os.kill(kernel.km.provisioner.process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), f"workers survived the kernel's {how}"
    written = {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert written == {"rank0.txt": "kept", "rank1.txt": "kept"}, f"after the kernel's {how}: {written}"


def test_live_status_while_running_and_only_the_grouped_output_stays():
    """The live view shows while a cell runs and is blanked before the output is printed; it never clears the
    cell's other output (the note on what a rank printed after its previous cell)."""
    k = Kernel(like_jupyterlab=True)
    try:
        k.execute("%load_ext course_utils")
        assert k.execute("%%ddp -n 2\nimport threading, time\n"
                         "threading.Timer(0.2, print, ('late', rank)).start()")[0] == "ok"
        time.sleep(1.0)
        msg_id = k.kc.execute("%%ddp\nfrom course_utils import progress\n"
                              "for i in progress(range(30), desc='train'):\n    time.sleep(0.1)\nprint('done', rank)")
        kinds, live_texts, final = [], [], []
        while True:
            msg = k.kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            kinds.append(kind)
            if kind in ("display_data", "update_display_data"):
                live_texts.append(msg["content"]["data"]["text/plain"])
            if kind == "stream":
                final.append(msg["content"]["text"])
            if kind == "status" and msg["content"]["execution_state"] == "idle":
                break
        k.reply(msg_id)
        assert "display_data" in kinds and "update_display_data" in kinds, kinds
        assert any("train [" in t and "[rank 1]" in t for t in live_texts), live_texts
        assert "clear_output" not in kinds, "the live view clears its own line, not the cell's output"
        assert live_texts[-1] == "", "the live line is blanked when the cell ends"
        last_update = len(kinds) - 1 - kinds[::-1].index("update_display_data")
        assert last_update < len(kinds) - 1 - kinds[::-1].index("stream"), "blanked before the output is printed"
        text = "".join(final)
        assert "printed this after its previous call had finished" in text and "[rank 1] late 1" in text, text
        assert text.endswith("[rank 0] done 0\n[rank 1] done 1\n"), text
    finally:
        k.close()


def test_line_magics_status_restart_shutdown_and_the_default_timeout(kernel):
    kernel.execute("%load_ext course_utils")
    assert kernel.execute("%ddp status")[1] == "no cluster running: the next %%ddp cell starts one\n"
    kernel.execute("%%ddp -n 2\nkept = rank")
    status, out, _ = kernel.execute("%ddp status")
    pids = kernel.worker_pids()
    backend = choose_backend("auto", 2)  # gloo here; nccl with 2 or more GPUs
    devices = "  rank 0: cpu\n  rank 1: cpu\n" if backend == "gloo" else ""  # on NCCL: cuda:N, its memory too
    assert out.startswith(f"2 ranks, backend {backend}, timeout 60 s, 0 restart(s), worker pids {pids}\n"
                          f"{devices}"), out
    if backend == "nccl":
        assert "  rank 1: cuda:1" in out, out
    assert kernel.execute("%ddp restart")[1] == f"restarted 2 {backend} ranks\n"
    assert kernel.worker_pids() != pids and not any(_alive(p) for p in pids)
    status, out, ename = kernel.execute("%ddp pull kept")
    assert ename == "NameError", "a restart starts fresh ranks: names are gone"
    pids = kernel.worker_pids()
    assert kernel.execute("%ddp shutdown")[0] == "ok"
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
    assert kernel.execute("%ddp status")[1] == "no cluster running: the next %%ddp cell starts one\n"


def test_a_cell_over_its_timeout_and_a_traceback_naming_the_kernel_cell(kernel):
    kernel.execute("%load_ext course_utils")
    kernel.execute("%%ddp -n 2\nimport time, torch.distributed as dist")
    t0 = time.monotonic()
    status, _, ename = kernel.execute("%%ddp --timeout 2\ntime.sleep(60 if rank == 1 else 0)")
    assert (status, ename) == ("error", "DistributedTimeout")
    assert "rank 1 did not finish within 2 s" in kernel.traceback and time.monotonic() - t0 < 50
    status, _, _ = kernel.execute("def faulty(x):\n    y = x + 1\n    return y / 0")
    defined_in = kernel.execution_count
    status, _, ename = kernel.execute("from course_utils import get_cluster\nget_cluster().run(faulty, 1)")
    assert ename == "DistributedError"
    assert f'File "Cell In[{defined_in}]", line 3, in faulty' in kernel.traceback, kernel.traceback
    assert "return y / 0" in kernel.traceback
