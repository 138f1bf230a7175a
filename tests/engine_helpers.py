"""Shared by the engine's test modules.

``Kernel``: a real IPython kernel driven through jupyter_client, as JupyterLab drives it.
"""
import os
import shutil
import sys
import tempfile
import time


class Kernel:
    """Isolated as browser_helpers.JupyterLab's server is: its own temporary HOME, IPython directory (profile,
    history, no startup files of the learner's), Jupyter config, data and runtime folders (the connection file),
    all removed by close()."""

    def __init__(self, like_jupyterlab=False):
        from jupyter_client.manager import KernelManager

        self.home = tempfile.mkdtemp(prefix="micro-ddp-kernel-")
        dirs = {"HOME": self.home, "IPYTHONDIR": os.path.join(self.home, ".ipython"),
                "JUPYTER_CONFIG_DIR": os.path.join(self.home, "config"),
                "JUPYTER_DATA_DIR": os.path.join(self.home, "data"),
                "JUPYTER_RUNTIME_DIR": os.path.join(self.home, "runtime"),
                "MPLCONFIGDIR": os.environ.get("MPLCONFIGDIR") or os.path.join(self.home, "matplotlib")}
        os.makedirs(dirs["JUPYTER_RUNTIME_DIR"])
        self.km = KernelManager(kernel_name="python3",
                                connection_file=os.path.join(dirs["JUPYTER_RUNTIME_DIR"], "kernel.json"))
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"], **dirs)
        env.pop("JUPYTER_PATH", None)
        if like_jupyterlab:  # not under pytest: the engine shows its live status line
            env.pop("PYTEST_CURRENT_TEST", None)
        try:
            self.km.start_kernel(cwd=os.path.dirname(os.path.dirname(__file__)), env=env)
            self.kc = self.km.client()
            self.kc.start_channels()
            self.kc.wait_for_ready(timeout=60)
        except BaseException:
            self.close()
            raise
        self.traceback = ""  # the last error's traceback text, colours removed

    def execute(self, code, timeout=180):
        """Run code; return (status, output text: streams and results in order, error name)."""
        import re

        msg_id = self.kc.execute(code)
        out, ename = [], None
        self.traceback = ""
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
                self.traceback = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                break
        reply = self.reply(msg_id)["content"]
        self.execution_count = reply.get("execution_count")
        return reply["status"], "".join(out), ename

    def reply(self, msg_id):
        while True:
            reply = self.kc.get_shell_msg(timeout=10)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def worker_pids(self):
        status, out, _ = self.execute("import course_utils.engine.magic as m\nprint(m._CLUSTER.pids)")
        assert status == "ok", out
        return eval(out.strip())

    def close(self):
        try:
            if getattr(self, "kc", None) is not None:
                self.kc.stop_channels()
            if self.km.is_alive():
                self.km.shutdown_kernel(now=True)
            self.km.cleanup_resources()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)
