"""The distributed cell engine: a persistent pool of ranks that notebook cells run on.

Introduced in 00_launcher_tour. Each rank is forked from a per-process fork server that has torch
imported (course_utils.engine._forkstart), or is a fresh Python interpreter where that server cannot
start; never a fork of the notebook process. torch.distributed is initialised once, so a cell
costs a pipe round trip, not a process start.
``spawn`` is the drop-in for ``torch.multiprocessing.spawn``: fresh ranks without a process group.
The notebook talks to its ranks over private pipes (and to the fork servers over socketpairs); the only
listening sockets are torch's own rendezvous store and the backend's connections, all on 127.0.0.1.
"""
import contextlib
import itertools
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref

from course_utils.engine import _forkstart, _wire
from course_utils.engine._forkstart import _sigint_held
from course_utils.engine.env import BACKENDS, _cpu_count, _gpu_count, choose_backend  # noqa: F401  (re-exported)
from course_utils.engine.ranks import (  # noqa: F401  (_Rank, _kill, _loopback_interface: for the tests)
    DONE_DRAIN_S, LIVE_LINES, _exit_of, _kill, _loopback_interface, _Rank, _shutdown, _spawn, read_fd)
from course_utils.engine.reports import (  # noqa: F401  (CellSyntaxError, DistributedTimeout: public, re-exported)
    CellSyntaxError, DistributedError, DistributedTimeout, failure_error, hide_cpp_frames,
    interrupt_error, plural, timeout_error, undecodable_info)

RELEASE_S = 5.0        # how long releasing the ranks may take before they are replaced
SETTLE_S = 0.3         # after a failure, how long the other ranks get to return on their own before the stop
STACKS_S = 2.0         # how long the ranks' control threads get to say where each rank is
FAILED_END_S = 0.3     # how long the ranks of a failed call get to end as a script does before they are killed
EXIT_CODE_S = 0.5      # how long a dead rank's exit code may take to arrive (its pipe closed as it exited)
START_TIMEOUT_S = 120  # importing torch on many ranks sharing two cores is slow
PG_TIMEOUT_MIN_S = 1800  # the backend's own timeout stays far above any cell's: the engine decides when a cell hung
POLL_S = 0.1           # how often the loop asks the OS whether a rank exited
DRAIN_S = 2.0          # how long the output of a dead rank is still read (a child it forked may hold the pipe)


def _under_nbval():
    return "PYTEST_CURRENT_TEST" in os.environ


# Makes the status display of a ``run()`` called without one (a checker's call, launch(fn)): set by the %%ddp
# magic's module when the notebook extension loads (``magic.CallView``), None in a plain Python process.
CALL_VIEW = None


_SERIALS = itertools.count(1)
_LIVE = weakref.WeakSet()  # every Cluster of this process that has ranks, for shutdown_all()


def shutdown_all():
    """Stop the ranks of every cluster of this process (%ddp shutdown): the %%ddp ranks, a checker's, a
    Cluster made in a cell. A cluster stopped so starts fresh ranks when it is used again."""
    errors = []
    for cluster in list(_LIVE):
        try:  # a busy or broken cluster does not leave the others running
            cluster.shutdown()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


class Cluster:
    """A persistent pool of ``world_size`` ranks with torch.distributed initialised.

    Introduced in 00_launcher_tour::

        with Cluster(world_size=4) as cluster:
            cluster.run("dist.get_rank()")      # -> [0, 1, 2, 3]
            cluster.run(train, lr=0.1)          # functions from notebook cells work

    Names defined by ``run`` persist on the ranks until ``restart()``. ``rank``, ``world_size``,
    ``local_rank`` and ``device`` are predefined on every rank.
    """

    def __init__(self, world_size=2, backend="auto", timeout=60, *, _group=True):
        if sys.platform == "win32":
            raise RuntimeError("native Windows is not supported: the engine hands its ranks pipes by file "
                               "descriptor, which Windows cannot do. Run the course in WSL 2 (make lab there).")
        self.serial = next(_SERIALS)  # which cluster this is, never reused (unlike id())
        self.backend = choose_backend(backend, world_size)
        self.requested_backend = backend
        self.world_size = world_size
        self.timeout = self._check_timeout(timeout)
        self._group = _group  # False: spawn()'s ranks, whose process group is the learner's business
        self._pg_timeout = self._pg_timeout_for(self.timeout)
        self._ranks = []
        self._run_id = 0
        self._generation = 0
        self._stack_id = 0
        self._finalizer = None
        self._held = []  # (rank, lines) printed by ranks that were since replaced
        self._done = {}  # run id -> {rank: (ok, value or error info)}
        self._live = None
        self._interrupted = False
        self._inbox = []  # messages other than results and progress, for the loop that waits for them
        self._sel = None  # selector over the live ranks' pipes (see _selector)
        self._next_poll = 0.0  # when to ask the OS again whether a rank exited
        self.pids = []
        self.started_at = None
        self.restarts = 0
        self._stale_group = False  # the ranks were released from a failed call: rebuild the group before the next
        self._lock = threading.RLock()  # one call at a time: see _exclusive
        self._start()

    @contextlib.contextmanager
    def _exclusive(self, what):
        """One call at a time on a cluster: a second thread's call (a restart() while a cell runs) is
        refused with a clear error instead of breaking the running call's pipes."""
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"{what}: this cluster is busy with a call from another thread. Wait for that "
                               "call to return (one call at a time per cluster), or use a Cluster of its own.")
        try:
            yield
        finally:
            self._lock.release()

    @staticmethod
    def _check_timeout(timeout):
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return float(timeout)

    @staticmethod
    def _pg_timeout_for(timeout):
        """The backend's timeout: far above the cell's, so that gloo or NCCL never gives up first."""
        return PG_TIMEOUT_MIN_S if math.isinf(timeout) else max(PG_TIMEOUT_MIN_S, 4 * timeout)

    # -- life cycle --------------------------------------------------------------------
    def _start(self):
        self._forget_selector()
        self._stale_group = False
        self._ranks = _spawn(self.world_size, self.backend, self._pg_timeout, self._group)
        self._generation = 0
        self._finalizer = weakref.finalize(self, _shutdown, list(self._ranks), 1.0)
        _LIVE.add(self)
        self.started_at = time.time()
        ready, errors = {}, {}
        try:
            def started():
                for rk, msg in self._take_messages():
                    if msg[0] == "ready":
                        (ready if msg[2] else errors)[rk.rank] = msg[3]
                return len(ready) + len(errors) == self.world_size or any(
                    rk.dead and rk.rank not in ready for rk in self._ranks)

            self._pump_until(started, time.monotonic() + START_TIMEOUT_S)
        except BaseException:  # a stop (KeyboardInterrupt) while the ranks start: none may be left running
            self._drop_ranks(_kill)
            raise
        if len(ready) < self.world_size:
            out = {rk.rank: [line for name, line in rk.take_lines() if name == "stderr"] for rk in self._ranks}
            self._drop_ranks(_kill)
            lines = [f"  rank {r}: {e['type']}: {e['message']}" for r, e in sorted(errors.items())]
            for r, stderr in sorted(out.items()):
                lines += [f"  [rank {r}] {line}" for line in stderr[-5:]]
            raise DistributedError(
                f"the {self.world_size} ranks did not start ({len(ready)} ready).", "\n".join(lines))
        self.pids = [ready[r]["pid"] for r in range(self.world_size)]
        _forkstart.start_second_server()  # once: the server that has torch._dynamo too (see _forkstart.LATER)

    def restart(self):
        """Replace every rank with a fresh one: all names defined on the ranks are gone."""
        with self._exclusive("restart()"):
            self._replace()

    def _replace(self, start=True, failed=False):
        """New ranks for the old; ``failed``: the old ones failed a call, and those still busy are interrupted
        and get FAILED_END_S to end as a script does before they are killed."""
        for rk in self._ranks:  # keep what the old ranks printed for this cell's output
            rk.flush_partial()
            self._held.append((rk.rank, rk.take_lines()))
            if failed and not rk.dead:
                with contextlib.suppress(OSError):
                    os.kill(rk.proc.pid, signal.SIGINT)
        self.shutdown(FAILED_END_S if failed else 2.0)
        self.restarts += 1
        if start:
            self._start()

    def shutdown(self, _wait_s=2.0):
        """Stop every rank. Safe to call twice."""
        with self._exclusive("shutdown()"), _sigint_held():  # a stop acts once the ranks are gone and forgotten
            _LIVE.discard(self)
            if self._ranks:
                self._drop_ranks(lambda ranks: _shutdown(ranks, _wait_s))

    def _drop_ranks(self, end):
        """End the ranks with ``end(ranks)`` (_kill or _shutdown) and forget them."""
        self._forget_selector()
        self._finalizer.detach()
        end(self._ranks)
        self._ranks = []

    @property
    def alive(self):
        return bool(self._ranks) and all(rk.proc.poll() is None for rk in self._ranks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __repr__(self):
        state = "running" if self.alive else "stopped"
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, timeout={self.timeout:g}) [{state}]"

    # -- public calls --------------------------------------------------------------------
    def run(self, code_or_fn, *args, timeout=None, **kwargs):
        """Run a string of code or a function on every rank; return the rank-ordered results.

        For a string, the result is the value of its last expression (None if there is none).
        ``timeout`` (seconds) overrides the cluster's for this call only (so a function's own
        ``timeout`` argument cannot be passed through ``run``: bind it with functools.partial).
        """
        if isinstance(code_or_fn, str):
            if args or kwargs:
                raise ValueError("arguments are only for functions: for code, push() the values first")
            return self.run_cell(code_or_fn, timeout=timeout, live=self._call_view())
        if not callable(code_or_fn):
            raise ValueError(f"run() takes a string of code or a function, got {type(code_or_fn).__name__}")
        return self._request(self._call_message(code_or_fn, args, kwargs), timeout, live=self._call_view())

    def _call_view(self):
        """A status line for a ``run()`` from the notebook (a checker's call): shown once the call has taken a
        second, blanked when it ends; none under nbval or outside a notebook kernel."""
        return None if CALL_VIEW is None or _under_nbval() else CALL_VIEW(self.world_size)

    def run_cell(self, source, filename="<ddp>", timeout=None, live=None, only_rank=None):
        """Run a cell's source on every rank (what ``%%ddp`` does); return the rank-ordered values.

        ``filename`` names the code in tracebacks ("Cell In[7]"); ``live`` is a status display with
        ``update(ranks, elapsed)`` and ``close()``; ``only_rank`` shows that rank's output only.
        A cell that does not parse raises ``CellSyntaxError`` before any rank runs."""
        __tracebackhide__ = True
        return self._request(self._code_message(source, filename), timeout, live=live, only_rank=only_rank)

    def push(self, **values):
        """Set names on every rank: ``cluster.push(lr=0.1, data=tensor)``."""
        blob = _dumps_named(values, "push")
        self._request(lambda run_id: ("push", run_id, blob), None)

    def pull(self, name):
        """The value of ``name`` on every rank, rank-ordered. NameError if a rank lacks it."""
        values = self._request(lambda run_id: ("pull", run_id, name), None)
        missing = [r for r, v in enumerate(values) if isinstance(v, type(_wire.MISSING))]
        if missing:
            raise NameError(f"name {name!r} is not defined on {plural(missing)}: define it in a %%ddp cell "
                            "(names do not survive a restart or a change of world size)")
        return values

    # -- messages ------------------------------------------------------------------------
    @staticmethod
    def _code_message(source, filename):
        try:
            compile(source, filename, "exec")
        except SyntaxError as exc:  # caught here, before any rank runs
            raise CellSyntaxError(exc) from None
        return lambda run_id: ("code", run_id, source, filename)

    @staticmethod
    def _call_message(fn, args, kwargs, with_rank=False):
        for i, a in enumerate(args):
            _dumps_named({f"argument {i} ({type(a).__name__})": a}, "run")
        _dumps_named(kwargs, "run")
        sources, rename = _sources_of(fn)
        try:
            blob = _wire.dumps((fn, args, kwargs), rename)
        except Exception as exc:
            raise ValueError(f"the function {getattr(fn, '__name__', fn)!r} cannot be sent to the ranks: "
                             f"{exc}. Create what it needs inside the function instead.") from None
        return lambda run_id: ("call", run_id, sources, blob, with_rank)

    # -- the loop ------------------------------------------------------------------------
    def _pump(self, wait):
        """Read whatever the ranks sent within ``wait`` seconds; keep results, progress and output."""
        sel = self._selector()
        if sel is None:
            time.sleep(wait)
            return
        poller, owner = sel
        writing = [rk for rk in self._ranks if rk.outbox and not rk.dead]
        for rk in writing:  # a rank that reads slowly (or not at all) gets the rest of its commands as it reads
            try:
                rk.flush()
            except OSError:
                rk.outbox.clear()  # it is gone: its result pipe's EOF says so
        if any(rk.outbox for rk in writing):
            wait = min(wait, 0.02)
        try:
            events = poller.poll(wait * 1000)
        except InterruptedError:
            events = []
        for fd, _ in events:
            self._read(owner[fd], fd)
        now = time.monotonic()
        if now >= self._next_poll:  # a rank whose forked child holds its pipes gives no EOF: ask the OS
            self._next_poll = now + POLL_S
            for rk in self._ranks:
                if not rk.dead and rk.proc.poll() is not None:
                    self._read(rk, rk.res_r)
                    self._mark_dead(rk)

    def _selector(self):
        """(poll object, fd -> rank) over the live ranks' pipes, registered once (poll, not select.select:
        it fails above fd 1024); rebuilt after ranks start, die or stop. None when no rank is alive."""
        if self._sel is None:
            live = [rk for rk in self._ranks if not rk.dead]
            if not live:
                return None
            poller, owner = select.poll(), {}
            for rk in live:
                for fd in rk.fds():
                    poller.register(fd, select.POLLIN)
                    owner[fd] = rk
            self._sel = poller, owner
        return self._sel

    def _forget_selector(self):
        self._sel = None

    def _read(self, rk, fd):
        if fd != rk.res_r:
            if not rk.read_stream(fd) and fd in rk.closed:
                self._forget_selector()  # registered again without the closed fd
            return
        data = read_fd(fd)
        if data is None:
            return
        if not data:
            self._mark_dead(rk)  # the worker's end closed: it exited
            return
        for m in rk.frames.feed(data):
            if isinstance(m, _wire.Undecodable):  # a reply the notebook cannot load is that rank's error
                m = ("done", self._run_id, rk.rank, False, undecodable_info(m.error))
            if m[0] == "progress":
                rk.progress = m[1:]  # (desc, i, total)
            elif m[0] == "done":  # kept per run, whichever loop happens to read it
                rk.drain_streams()  # what the rank wrote before it said so is in its pipes already
                self._done.setdefault(m[1], {}).setdefault(rk.rank, (m[3], m[4]))
            else:
                self._inbox.append((rk, m))

    def _mark_dead(self, rk):
        if rk.dead:
            return
        rk.dead, rk.died_at = True, time.time()
        self._forget_selector()
        rk.drain_streams(DRAIN_S, quiet=0.2)  # what it printed before it died is kept
        rk.flush_partial()

    def _take_messages(self):
        out, self._inbox = self._inbox, []
        return out

    def _pump_until(self, condition, deadline, step=0.05):
        """Pump until ``condition()`` is true or ``deadline`` (time.monotonic) passes; return whether it held.
        (A stop during these loops, which are the engine's own, only sets the flag: no nested recovery.)"""
        while True:
            if condition():
                return True
            if time.monotonic() >= deadline:
                return False
            self._pump(min(step, max(0.0, deadline - time.monotonic())))

    def _send(self, ranks, message):
        """Send ``message`` to each of ``ranks``; a rank that cannot be written to is dead."""
        for rk in ranks:
            try:
                rk.send(message)
            except OSError:
                self._mark_dead(rk)

    def _stop_pressed(self):
        self._interrupted = True

    def _request(self, make, timeout, live=None, only_rank=None):
        __tracebackhide__ = True
        timeout = self.timeout if timeout is None else self._check_timeout(timeout)
        with self._exclusive("a call"):
            return self._request_exclusive(make, timeout, live, only_rank)

    def _printing(self):
        """The live ranks with something in a stream pipe now: one poll over every pipe, rather than reading
        each empty one to its EAGAIN (before and after every call, per rank)."""
        sel = self._selector()
        if sel is None:
            return set()
        poller, owner = sel
        return {owner[fd].rank for fd, _ in poller.poll(0) if fd != owner[fd].res_r}

    def _request_exclusive(self, make, timeout, live, only_rank):
        __tracebackhide__ = True
        if not self._ranks:
            self._start()
        elif not self.alive:
            raise self._failure(None, None)  # a rank died between calls: this call does not run
        else:
            self._show(None, late=True)  # what the ranks printed since their last call, under a note
        self._interrupted = False
        with _sigint_held(self._stop_pressed):
            # the group released after a failure is rebuilt now, and for a long --timeout (the backend must not give
            # up first) with that timeout
            if self._group and (self._stale_group or self._pg_timeout < self._pg_timeout_for(timeout)):
                if not self._rebuild_group(max(self._pg_timeout, self._pg_timeout_for(timeout))):
                    self._replace(start=True)  # a rank could not join the new group: fresh ranks, said so
                    print("note: the ranks could not rebuild their process group and were replaced; names you "
                          "defined on them are gone.", file=sys.stderr)
            for rk in self._ranks:  # the live status shows this cell's lines only
                rk.progress = None
                rk.recent.clear()
            self._run_id += 1
            run_id = self._run_id
            self._done = {run_id: {}}
            results = self._done[run_id]
            self._live = live
            try:
                self._send(self._ranks, make(run_id))
                t0 = time.monotonic()
                deadline, ranks = t0 + timeout, self._ranks
                while True:  # the hot loop of every cell: written out, not through _pump_until
                    if not all(ok for ok, _ in results.values()) or any(
                            rk.dead and rk.rank not in results for rk in ranks):
                        raise self._failure(run_id, only_rank)  # the first failure wins: no waiting for others
                    if len(results) == len(ranks):
                        break
                    now = time.monotonic()
                    if now >= deadline:
                        raise self._timeout(run_id, only_rank, timeout)
                    if self._interrupted:
                        raise KeyboardInterrupt
                    self._pump(min(0.05, deadline - now))
                    if live is not None:
                        live.update(ranks, time.monotonic() - t0)
            except KeyboardInterrupt:
                snapshot = dict(self._done.get(run_id, {}))
                stacks = self._stacks(snapshot)
                note = self._recover(run_id)
                self._show(only_rank)
                raise interrupt_error(self.world_size, snapshot, stacks, note) from None
            finally:
                self._close_live()
        self._show(only_rank)
        return [results[r][1] for r in range(self.world_size)]

    def _close_live(self):
        live, self._live = self._live, None
        if live is not None:
            live.close()

    def _show(self, only_rank, late=False):
        """Print every rank's output, grouped in rank order (so the stored output is deterministic), each rank's
        lines in the order they arrived; ``only_rank`` hides the other ranks' stdout. ``late``: what the ranks
        printed after their previous call had finished (a background thread, a child process), under a note."""
        self._close_live()
        printing = self._printing()   # a dead rank's pipes were read when it was found dead
        for rk in self._ranks:
            if rk.rank in printing:
                rk.drain_streams(0.2 if late else DONE_DRAIN_S)
            rk.flush_partial()
        held, self._held = self._held, []
        merged = {}
        for rank, lines in held + [(rk.rank, rk.take_lines()) for rk in self._ranks]:
            merged.setdefault(rank, []).extend(
                (name, line) for name, line in lines if name == "stderr" or only_rank in (None, rank))
        for rank, lines in sorted(merged.items()):
            if late and lines:
                print(f"note: rank {rank} printed this after its previous call had finished (a background thread "
                      f"or a child process):", file=sys.stderr if lines[0][0] == "stderr" else sys.stdout)
            for name, run in itertools.groupby(lines, key=lambda item: item[0]):
                stream = getattr(sys, name)
                stream.write("".join(f"[rank {rank}] {line}\n" for line in hide_cpp_frames(t for _, t in run)))
                stream.flush()

    def _ask_all(self, ranks, message, answered, seconds):
        """Send ``message`` to ``ranks`` and pump until ``answered()`` holds, a rank dies, or ``seconds`` pass;
        return whether it held."""
        self._send(ranks, message)
        return self._pump_until(answered, time.monotonic() + seconds)

    def _stacks(self, results):
        """Where each live rank without a result in ``results`` is, from its control thread (milliseconds; a rank
        that dies meanwhile or cannot answer within STACKS_S is left out)."""
        ranks = [rk for rk in self._ranks if rk.rank not in results and not rk.dead]
        if not ranks:
            return {}
        self._stack_id += 1
        sid, got = self._stack_id, {}

        def answered():
            for rk, msg in self._take_messages():
                if msg[0] == "stacks" and msg[1] == sid:
                    got[rk.rank] = msg[3]
            return all(rk.rank in got or rk.dead for rk in ranks)

        self._ask_all(ranks, ("stacks", sid), answered, STACKS_S)
        return got

    def _rebuild_group(self, pg_timeout=None):
        """A new process group on the same ranks (names kept); False if a rank failed to join it."""
        self._stale_group = False
        self._generation += 1
        gen = self._generation
        if pg_timeout is not None:
            self._pg_timeout = pg_timeout
        self._run_id += 1
        done = self._done.setdefault(self._run_id, {})
        joined = lambda: all(rk.rank in done for rk in self._ranks) or any(rk.dead for rk in self._ranks)
        self._ask_all(self._ranks, ("reset", self._run_id, gen, self._pg_timeout), joined, 30)
        return all(rk.rank in done and done[rk.rank][0] for rk in self._ranks)

    def _recover(self, run_id, verdict=False):
        """Release every live rank at once: abort its collectives and interrupt its code, and wait (at most
        RELEASE_S) until each has returned. The process group is rebuilt at the next call (the report does not
        wait for it); after a death, on spawn()'s one-shot ranks, or when a rank is not released, the ranks are
        replaced. ``verdict``: the failure is a checker's verdict, and the other ranks run the same check: their
        collectives are aborted first and each gets up to RELEASE_S to reach its own verdict before it is
        interrupted (a wrong answer is then reported once, for every rank). Any other failure gives them SETTLE_S
        after the abort: a rank a moment behind on the same line raises its own error, so a bug every rank hits is
        blamed on the same rank every run (lesson 08's refused hook; tests/test_engine_faults.py). Returns a note
        for the report."""
        results = self._done.setdefault(run_id, {})
        live = [rk for rk in self._ranks if not rk.dead]
        returned = lambda: all(rk.rank in results or rk.dead for rk in self._ranks)  # noqa: E731
        self._ask_all(live, ("abort",), returned, RELEASE_S if verdict else SETTLE_S)
        for rk in live:
            if rk.rank not in results:
                with contextlib.suppress(OSError):
                    os.kill(rk.proc.pid, signal.SIGINT)  # Python loops and sleeps stop here
        released = self._ask_all(live, ("abort",), returned, RELEASE_S)
        if released and self._group and not any(rk.dead for rk in self._ranks):
            self._stale_group = True
            return "The ranks were released and the process group rebuilt; names you defined are kept."
        self._replace(start=False, failed=True)  # fresh ranks start with the next call: the report comes now
        if not self._group:  # spawn(): one-shot ranks; the others stopped, as torch.multiprocessing.spawn does
            return "The other ranks were stopped."
        return "The ranks were replaced with fresh ones; names you defined on them are gone."

    # -- errors ------------------------------------------------------------------------
    def _failure(self, run_id, only_rank):
        """The report of the first error or death, made at once: where the other ranks are (their stacks),
        then they are released (or replaced, after a death), and the root cause is the failure that came
        first by the ranks' own clocks: an error's time stamp, or when a dead rank's pipe closed.
        ``run_id`` None: ranks found dead before a call, which then does not run."""
        __tracebackhide__ = True
        results = dict(self._done.get(run_id, {}))  # one moment: what had finished when the failure was seen
        stacks = self._stacks(results) if run_id is not None else {}
        for rk in self._ranks:  # ranks that died with it, seen while the stacks were asked for, are named too
            if not rk.dead and rk.proc.poll() is not None:
                self._mark_dead(rk)
        dead = [rk for rk in self._ranks if rk.dead and rk.rank not in results]
        codes = self._exit_codes(dead)
        deaths = {rk.rank: rk.died_at for rk in dead}
        if run_id is None:
            self._replace(start=False, failed=True)
            note = ("It died between calls: this call did not run. The ranks were replaced with fresh ones; names "
                    "you defined on them are gone.")
        else:
            note = self._recover(run_id, verdict=any(not ok and info.get("verdict") for ok, info in results.values()))
            for r, (ok, info) in self._done.get(run_id, {}).items():  # what came in while they were released:
                if r not in results and (ok or info["type"] != "KeyboardInterrupt"):
                    results[r] = (ok, info)  # their own results and errors, not the stop that released them
                elif r not in results and not stacks.get(r, {}).get("where"):  # not in the cell yet when asked
                    stacks[r] = {"where": info.get("where"), "busy": True}  # where the stop found it
        self._show(only_rank)
        return failure_error(self.world_size, results, stacks, codes, deaths, note, everyone=run_id is not None)

    @staticmethod
    def _exit_codes(dead):
        """Each dead rank's exit code: at once on Linux (/proc, or our own child's), else as soon as its fork
        server reports it, waited for at most EXIT_CODE_S in all (unknown after that: None)."""
        deadline = time.monotonic() + EXIT_CODE_S
        for rk in dead:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rk.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return {rk.rank: _exit_of(rk.proc) for rk in dead}

    def _timeout(self, run_id, only_rank, timeout):
        __tracebackhide__ = True
        results = dict(self._done.get(run_id, {}))  # the moment the time ran out
        stacks = self._stacks(results)
        note = self._recover(run_id)
        self._show(only_rank)
        return timeout_error(self.world_size, results, stacks, timeout, note, backend=self.backend)


def _dumps_named(values, what):
    for name, value in values.items():
        try:
            _wire.dumps(value)
        except Exception as exc:
            raise ValueError(f"{what}: {name!s} cannot be sent to the ranks ({type(value).__name__}: {exc}). "
                             "Send plain data or tensors, or create the object on the ranks.") from None
    return _wire.dumps(values)


def cell_names():
    """IPython's map from a cell's compiled filename to the 'Cell In[N]' it shows in tracebacks."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    ip = get_ipython()
    fmap = getattr(getattr(ip, "compile", None), "_filename_map", None) or {}
    return {name: f"Cell In[{n}]" for name, n in fmap.items()}


def _sources_of(fn):
    """Source of the notebook cells that define ``fn`` and the code it nests, and their 'Cell In[N]' names."""
    import linecache

    names = cell_names()
    sources, rename = {}, {}
    codes = [getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)]
    while codes:
        code = codes.pop()
        if code is None:
            continue
        name = code.co_filename
        lines = linecache.cache.get(name)
        if lines and not os.path.exists(name):
            shown = rename[name] = names.get(name, name)
            sources[shown] = "".join(lines[2])
        codes += [c for c in code.co_consts if hasattr(c, "co_filename")]
    return sources, rename
