"""The ``%%ddp`` cell magic and ``%ddp`` line magics (00_launcher_tour).

    %%ddp -n 4                  run this cell on 4 ranks (gloo on CPU, NCCL with a GPU per rank)
    %%ddp --rank 0              show rank 0's output only
    %ddp pull NAME / push NAME  move a value between the notebook and the ranks
    %ddp status / restart / shutdown
    %ddp export PATH            write the %%ddp cells run so far as a torchrun script
"""
import argparse
import shlex
import sys
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from course_utils.engine import launcher
from course_utils.engine.progress import bar

_CLUSTER = None
_CELLS = []  # for export: (session, "cell", options, source) of each %%ddp cell run successfully and
#              (session, "push", name, pickled value) of each %ddp push;
#              session = (cluster serial, restarts, size, backend): a serial, since an id() is reused


def _session(cluster):
    """Which set of ranks ran a cell: names from another session were gone for it."""
    return cluster.serial, cluster.restarts, cluster.world_size, cluster.backend


def shutdown_cluster():
    global _CLUSTER
    if _CLUSTER is not None:
        _CLUSTER.shutdown()
        _CLUSTER = None


def shutdown_everything():
    """%ddp shutdown: the %%ddp ranks and every other cluster of this kernel (a checker's, a Cluster made in
    a cell: those start fresh ranks when used again)."""
    shutdown_cluster()
    launcher.shutdown_all()


def unload():
    """%unload_ext course_utils: every cluster stops, then the fork server, so that %load_ext course_utils
    starts a new one (one that sees environment variables set since, e.g. TORCHDYNAMO_VERBOSE)."""
    from course_utils.engine import _forkstart

    shutdown_everything()
    _forkstart.stop()


class RankValues(list):
    """Rank-ordered values that display as ``[rank N] value`` lines."""

    only_rank = None

    def _repr_pretty_(self, p, cycle):
        p.text(self._text())

    def __repr__(self):
        return self._text()

    def _text(self):
        lines = []
        for r, value in enumerate(self):
            if self.only_rank is not None and r != self.only_rank:
                continue
            lines += [f"[rank {r}] {line}" for line in repr(value).splitlines() or [""]]
        return "\n".join(lines)


class LiveView:
    """While a cell runs: per rank, its progress bar or the last few lines it printed (launcher.LIVE_LINES). Blanked
    before the cell's output is printed, and never shown under nbval: stored outputs hold the grouped output only."""

    def __init__(self, world_size):
        self.handle = None
        self.shown_at = 0.0
        self.world_size = world_size

    def starting(self, world_size):
        """Shown while fresh ranks import torch (seconds), so a first cell is not silent."""
        from IPython.display import display

        text = f"starting {world_size} ranks..."
        self.handle = display({"text/plain": text}, raw=True, display_id=True)

    def update(self, ranks, elapsed):
        if elapsed < 0.5 or time.monotonic() - self.shown_at < 0.25:
            return
        from IPython.display import display

        lines = [f"running on {self.world_size} ranks: {elapsed:.0f} s"]
        for rk in ranks:  # a progress bar, else the last few whole lines the rank printed
            shown = [bar(*rk.progress)] if rk.progress else list(rk.recent) or [""]
            lines += [f"[rank {rk.rank}] {line[:150]}" for line in shown]
        data = {"text/plain": "\n".join(lines)}
        if self.handle is None:
            self.handle = display(data, raw=True, display_id=True)
        else:
            self.handle.update(data, raw=True)
        self.shown_at = time.monotonic()

    def close(self):
        """Blank this view's own display: clear_output() would also wipe what the cell showed before it (the note
        on what a rank printed after its previous call, the fresh-interpreters note)."""
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)
            self.handle = None


class CallView(LiveView):
    """LiveView for a ``Cluster.run`` that a notebook cell makes without ``%%ddp`` (a checker's call): shown only
    once the call has run for ``DELAY_S``."""

    DELAY_S = 1.0

    def __new__(cls, world_size):
        try:
            from IPython import get_ipython
        except ImportError:
            return None
        shell = get_ipython()
        if shell is None or not hasattr(shell, "kernel"):  # a terminal IPython or a plain script: no display
            return None
        return super().__new__(cls)

    def update(self, ranks, elapsed):
        if elapsed >= self.DELAY_S:
            super().update(ranks, elapsed)


launcher.CALL_VIEW = CallView


def _this_cell_name():
    """'Cell In[N]' for the cell running now, as IPython names it in its own tracebacks."""
    names = launcher.cell_names()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename in names:
            return names[frame.f_code.co_filename]
        frame = frame.f_back
    return "<ddp cell>"


def _cell_parser():
    p = argparse.ArgumentParser(prog="%%ddp", add_help=False, exit_on_error=False)
    p.add_argument("-n", "--world-size", type=int, default=None)
    p.add_argument("--backend", default=None, choices=launcher.BACKENDS)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--rank", type=int, default=None)
    return p


OPTIONS = "Options: -n/--world-size N, --backend auto|gloo|nccl, --timeout SECONDS, --rank R"


def _parse(line):
    """Options of a %%ddp line; a mistake is a UsageError (IPython shows just the message)."""
    try:
        args, rest = _cell_parser().parse_known_args(shlex.split(line, comments=True))
    except (argparse.ArgumentError, SystemExit, ValueError) as exc:
        raise UsageError(f"%%ddp: {exc}. {OPTIONS}") from None
    if rest:
        raise UsageError(f"%%ddp: unknown option(s) {' '.join(rest)}. {OPTIONS}")
    if args.world_size is not None and args.world_size < 1:
        raise UsageError(f"%%ddp -n {args.world_size}: the world size must be at least 1.")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"%%ddp --timeout {args.timeout:g}: the timeout must be a positive number of seconds.")
    size = args.world_size if args.world_size is not None else (_CLUSTER.world_size if _CLUSTER else 2)
    if args.rank is not None and not 0 <= args.rank < size:
        raise UsageError(f"%%ddp --rank {args.rank}: there is no such rank. Ranks go from 0 to {size - 1}.")
    if args.backend is not None:
        try:  # e.g. nccl without a GPU per rank: an option mistake, found before the ranks are touched
            launcher.choose_backend(args.backend, size)
        except ValueError as exc:
            raise UsageError(f"%%ddp --backend {args.backend}: {exc}") from None
    return args


def get_cluster(world_size=None, backend=None):
    """The notebook's persistent cluster (the one ``%%ddp`` cells run on), started if needed."""
    return _cluster_for(world_size, backend)[0]


def _cluster_for(world_size=None, backend=None, live=None):
    """The notebook's cluster, (re)started if the requested shape differs, and a note that says
    when ranks holding names were replaced."""
    global _CLUSTER
    c, note, size = _CLUSTER, None, world_size
    if c is not None and ((world_size is not None and world_size != c.world_size)
                          or (backend is not None and launcher.choose_backend(backend, world_size or c.world_size)
                              != c.backend)):  # the backend chosen, not the word typed: auto may be gloo
        size = world_size or c.world_size
        backend = backend or c.requested_backend
        launcher.choose_backend(backend, size)  # bad input raises here, before the old ranks are stopped
        note = f"(started {size} fresh ranks: the names defined on the previous {c.world_size} are gone)"
        shutdown_cluster()
        c = None
    if c is None:
        size = size or 2
        launcher.choose_backend(backend or "auto", size)
        if live is not None:
            live.starting(size)
        c = _CLUSTER = launcher.Cluster(world_size=size, backend=backend or "auto")
    return c, note


@magics_class
class DDPMagics(Magics):
    @line_cell_magic
    def ddp(self, line, cell=None):
        __tracebackhide__ = True
        if cell is None:
            return self._line(line)
        args = _parse(line)
        live = None if launcher._under_nbval() else LiveView(args.world_size or 2)
        try:
            cluster, note = _cluster_for(args.world_size, args.backend, live)
            if live is not None:
                live.world_size = cluster.world_size
            values = cluster.run_cell(cell, _this_cell_name(), timeout=args.timeout, live=live, only_rank=args.rank)
        except BaseException:
            if live is not None:
                live.close()
            raise
        if note:
            print(note)
        _CELLS.append((_session(cluster), "cell", line, cell))
        if all(v is None for v in values):
            return None
        out = RankValues(values)
        out.only_rank = args.rank
        return out

    def _line(self, line):
        words = shlex.split(line)
        if not words:
            return self._status()
        cmd, rest = words[0], words[1:]
        if cmd in ("pull", "push") and len(rest) != 1:
            raise UsageError(f"usage: %ddp {cmd} NAME")
        if cmd == "pull":
            if _CLUSTER is None:
                raise UsageError(f"%ddp pull {rest[0]}: no ranks are running. Run a %%ddp cell first.")
            return RankValues(_CLUSTER.pull(rest[0]))
        if cmd == "push":
            name = rest[0]
            if name not in self.shell.user_ns:
                raise UsageError(f"%ddp push {name}: {name!r} is not defined in the notebook. Define it first.")
            import cloudpickle

            cluster = get_cluster()
            cluster.push(**{name: self.shell.user_ns[name]})
            _CELLS.append((_session(cluster), "push", name, cloudpickle.dumps({name: self.shell.user_ns[name]})))
            return None
        if cmd == "restart":
            get_cluster().restart()
            print(f"restarted {_CLUSTER.world_size} {_CLUSTER.backend} ranks")
            return None
        if cmd == "shutdown":
            shutdown_everything()
            return None
        if cmd == "status":
            return self._status()
        if cmd == "export":
            if len(rest) != 1:
                raise UsageError("usage: %ddp export PATH")
            from course_utils.engine.export import write_script

            if not _CELLS:
                raise UsageError("%ddp export: no %%ddp cell has run yet: nothing to export.")
            last = _CELLS[-1][0]
            kept = [item[1:] for item in _CELLS if item[0] == last]
            left_out = sum(1 for item in _CELLS if item[0] != last and item[1] == "cell")
            write_script(rest[0], kept, world_size=last[2], left_out=left_out, backend=last[3])
            cells = sum(1 for item in kept if item[0] == "cell")
            extra = f" (left out: {left_out} cell(s) run on ranks replaced since)" if left_out else ""
            print(f"wrote {cells} %%ddp cells to {rest[0]}{extra}; "
                  f"run it with: torchrun --standalone --nproc-per-node={last[2]} {rest[0]}")
            return None
        raise UsageError(f"%ddp {cmd}: unknown command. "
                         "Use pull NAME, push NAME, restart, status, shutdown or export PATH.")

    def _status(self):
        c = _CLUSTER
        if c is None or not c.alive:
            print("no cluster running: the next %%ddp cell starts one")
            return None
        print(f"{c.world_size} ranks, backend {c.backend}, timeout {c.timeout:g} s, "
              f"{c.restarts} restart(s), worker pids {c.pids}")
        from course_utils.engine._worker import rank_status

        for r, (device, used, peak) in enumerate(c.run(rank_status)):
            memory = f": {used / 2**30:.2f} GiB in use, {peak / 2**30:.2f} GiB at peak" if used is not None else ""
            print(f"  rank {r}: {device}{memory}")
        return None
