"""Shared by the engine's test modules.

``Kernel``: a real IPython kernel driven through jupyter_client, as JupyterLab drives it.
"""
import os
import sys
import time


class Kernel:
    def __init__(self, like_jupyterlab=False):
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        if like_jupyterlab:  # not under pytest: the engine shows its live status line
            env.pop("PYTEST_CURRENT_TEST", None)
        self.km.start_kernel(cwd=os.path.dirname(os.path.dirname(__file__)), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
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
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)
