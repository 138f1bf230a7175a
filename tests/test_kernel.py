"""The %%ddp magic in a real IPython kernel, driven through jupyter_client as JupyterLab drives it:
the stop button (SIGINT to the kernel), and a kernel that dies must not leave workers behind."""
import os
import signal
import sys
import time

import pytest
from jupyter_client.manager import KernelManager


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


class Kernel:
    def __init__(self, like_jupyterlab=False):
        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        if like_jupyterlab:  # not under pytest: the engine shows its live status line
            env.pop("PYTEST_CURRENT_TEST", None)
        self.km.start_kernel(cwd=os.path.dirname(os.path.dirname(__file__)), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def execute(self, code, timeout=120):
        """Run code; return (status, stdout text, error name)."""
        msg_id = self.kc.execute(code)
        out, ename = [], None
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "execute_result":
                out.append(content["data"]["text/plain"] + "\n")
            elif kind == "error":
                ename = content["ename"]
            elif kind == "status" and content["execution_state"] == "idle":
                break
        return self.reply(msg_id)["content"]["status"], "".join(out), ename

    def reply(self, msg_id):
        while True:
            reply = self.kc.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def worker_pids(self):
        status, out, _ = self.execute("import course_utils.engine.magic\nprint(course_utils.engine.magic._CLUSTER.pids)")
        assert status == "ok", out
        return eval(out.strip())

    def close(self):
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


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
    for bad in ("--bogus 1", "-n four", "-n 0", "--rank 9", "--timeout -1", "--backend nccl"):
        status, out, ename = kernel.execute(f"%%ddp {bad}\n1")
        assert status == "error", bad
        assert ename == "ValueError" or "UsageError: %%ddp" in out, (bad, ename, out)  # IPython prints UsageErrors
    assert kernel.execute("%%ddp\nrank")[1] == "[rank 0] 0\n[rank 1] 1\n", "a bad option must not touch the ranks"
    status, out, _ = kernel.execute("%%ddp -n 3  # a comment after the options is fine\nrank")
    assert out == ("(started 3 fresh ranks: the names defined on the previous 2 are gone)\n"
                   "[rank 0] 0\n[rank 1] 1\n[rank 2] 2\n"), out
    status, out, _ = kernel.execute("%%ddp --backend gloo\nworld_size")  # a new backend keeps the size
    assert out.endswith("[rank 0] 3\n[rank 1] 3\n[rank 2] 3\n"), out


def test_stop_button_interrupts_the_cell_and_the_next_cell_works(kernel):
    kernel.execute("%load_ext course_utils")
    assert kernel.execute("%%ddp -n 2\nkept = 7")[0] == "ok"
    msg_id = kernel.kc.execute("%%ddp\nimport time\nwhile True:\n    time.sleep(0.01)")
    time.sleep(2)
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
    assert ename == "KeyboardInterrupt"
    assert time.monotonic() - t0 < 10, "the stop button must stop the cell within a few seconds"
    status, out, _ = kernel.execute("%%ddp\nrank")
    assert (status, out) == ("ok", "[rank 0] 0\n[rank 1] 1\n")


@pytest.mark.parametrize("how", ["shutdown", "restart", "sigkill"])
def test_kernel_end_leaves_no_worker(kernel, how):
    kernel.execute("%load_ext course_utils")
    assert kernel.execute("%%ddp -n 2\nrank")[0] == "ok"
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


def test_live_status_while_running_and_only_the_grouped_output_stays():
    k = Kernel(like_jupyterlab=True)
    try:
        k.execute("%load_ext course_utils")
        assert k.execute("%%ddp -n 2\nimport time")[0] == "ok"
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
        assert kinds.index("clear_output") < kinds.index("stream"), "the live line is cleared before the output"
        assert "".join(final) == "[rank 0] done 0\n[rank 1] done 1\n"
    finally:
        k.close()
