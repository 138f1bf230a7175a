"""The error reports of a Cluster: what failed, where each rank was, and what the engine did about it.

Pure functions of a snapshot taken by the launcher, so that every list in a report comes from one
moment (a rank is never both "stuck" and "finished").
"""
import os
import re
import signal
import time
import traceback

_CPP_FRAME = re.compile(r"^\s*frame #\d+: ")
_RELEASED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "released by the engine")


class CellSyntaxError(ValueError):
    """The code sent to the ranks does not parse; nothing ran. Shows just the offending line."""

    def __init__(self, error):
        self.error = error
        self.lines = traceback.format_exception_only(type(error), error)
        super().__init__("".join(self.lines).rstrip() + "\n(nothing ran on the ranks: fix the line above)")

    def _render_traceback_(self):
        return "".join(self.lines).rstrip().splitlines() + ["(nothing ran on the ranks: fix the line above)"]


def undecodable_info(error):
    """The error info of a rank whose reply the notebook could not load: that rank's error."""
    return {"type": type(error).__name__,
            "message": f"the rank's reply could not be loaded in the notebook: {error}",
            "traceback": f"{type(error).__name__}: {error}\n", "where": "", "time": time.time()}


class _Report:
    """A summary line and its details, shown by IPython without the engine's frames (``_render_traceback_``)."""

    def __str__(self):
        return self.summary + ("\n" + self.details if self.details else "")

    def _render_traceback_(self):
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


class DistributedError(_Report, RuntimeError):
    """A rank failed. ``str()`` names the first failing rank, its traceback and the others' state."""

    def __init__(self, summary, details="", *, rank=None, exc_type=None, exc_message=None,
                 rank_traceback=None, ranks=None, stacks=None):
        super().__init__(summary)
        self.stacks = stacks or {}  # rank -> its Python stack (a timeout's stuck ranks), as text
        self.summary, self.details = summary, details
        self.rank, self.exc_type, self.exc_message = rank, exc_type, exc_message
        self.rank_traceback = rank_traceback
        self.ranks = ranks or {}  # rank -> what it was doing


class DistributedInterrupt(_Report, KeyboardInterrupt):
    """The learner pressed stop: says where each rank was and what the engine did."""

    def __init__(self, summary, details=""):
        super().__init__(summary)
        self.summary, self.details = summary, details


def interrupt_error(world_size, results, stacks, note):
    """``results`` and ``stacks``: the snapshot taken when the stop arrived, before the ranks were released."""
    lines = []
    for r in range(world_size):
        if r in results:
            lines.append(f"  rank {r}: {'had finished' if results[r][0] else 'had raised ' + results[r][1]['type']}")
        else:
            where = stacks.get(r, {}).get("where")
            lines.append(f"  rank {r}: was running {where}" if where else f"  rank {r}: was running")
    return DistributedInterrupt(f"interrupted: every rank stopped. {note}", "Where the ranks were:\n" +
                                "\n".join(lines))


class DistributedTimeout(DistributedError, TimeoutError):
    """No result within ``timeout`` seconds: says which ranks finished and where the others are stuck."""


def plural(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def hide_cpp_frames(lines):
    """Collapse each run of C++ frame lines ("frame #11: ... libtorch_python.so") into one line
    that says how many were hidden, unless TORCH_SHOW_CPP_STACKTRACES=1 asks for them."""
    if os.environ.get("TORCH_SHOW_CPP_STACKTRACES", "0") not in ("", "0"):
        return list(lines)
    out, run = [], 0
    for line in list(lines) + [None]:
        if line is not None and _CPP_FRAME.match(line):
            run += 1
            continue
        if run:
            frames = f"{run} C++ frame{'s' if run > 1 else ''}"
            out.append(f"[{frames} hidden: set TORCH_SHOW_CPP_STACKTRACES=1 to see them]")
            run = 0
        if line is not None:
            out.append(line)
    return out


def hide_cpp_frames_text(text):
    return "\n".join(hide_cpp_frames(text.split("\n")))


def released(error):
    """An error that only says a rank was let go from a collective because another rank failed or stopped."""
    return any(m in error["message"] for m in _RELEASED)


def first_failure(errors):
    """The rank to blame: among the failures (error infos, or a death's {"type": "died", "time": ...}) that are
    not just a rank being released from a collective, the earliest by the ranks' own clocks; and of those that
    raised the same exception at the same place as it, or within a second of it, the lowest rank. A bug that hits
    every rank is then blamed on the same rank every run, however the ranks were scheduled."""
    causes = {r: e for r, e in errors.items() if not released(e)} or errors
    first = min(causes, key=lambda r: (causes[r]["time"], r))
    same = (causes[first]["type"], causes[first].get("where"))
    return min(r for r, e in causes.items()
               if (e["type"], e.get("where")) == same or e["time"] <= causes[first]["time"] + 1.0)


def describe(rank, results, stacks, first):
    """What ``rank`` was doing in the snapshot ``results`` (rank -> (ok, payload)) and ``stacks``."""
    if rank in results:
        ok, payload = results[rank]
        if ok:
            return "finished"
        where = f" {payload['where']}" if payload.get("where") else ""
        if released(payload):
            return f"was waiting{where} and was released"
        return f"{'raised' if rank == first else 'then raised'} {payload['type']}{where}"
    info = stacks.get(rank)
    if info and info.get("where") and info.get("collective"):  # released with the rest: as if its reply had come
        return f"was waiting {info['where']} and was released"
    if info and info.get("where"):
        return f"was running {info['where']}"
    return "was running"


def _same_verdict(world_size, errors):
    """Every rank failed a checker with the very same verdict (a wrong answer fails on each rank alike)."""
    first = errors.get(0)
    return len(errors) == world_size and first is not None and first.get("verdict") and all(
        (e["type"], e["message"], e.get("where")) == (first["type"], first["message"], first.get("where"))
        for e in errors.values())


def _same_verdict_error(world_size, e, note):
    tb = e["traceback"].rstrip()
    cut = tb.rfind(f"\n{e['type']}")
    lines = [hide_cpp_frames_text(tb[:cut])] if cut > 0 else []
    if note:
        lines += ["", note]
    ranks = {r: "raised the same error" for r in range(1, world_size)}
    return DistributedError(
        f"every rank failed the check with {e['type']}: {hide_cpp_frames_text(e['message'])}", "\n".join(lines),
        rank=0, exc_type=e["type"], exc_message=e["message"], rank_traceback=e["traceback"], ranks=ranks)


def failure_error(world_size, results, stacks, codes, deaths, note, everyone=True):
    """The report of a failed call: its root cause (the first failure, see first_failure) and, with
    ``everyone``, what every other rank was doing. ``results`` and ``stacks``: the snapshot taken when the
    failure was seen; ``codes``: dead rank -> exit code (see dead_error); ``deaths``: dead rank -> time.time()
    when its pipe closed."""
    errors = {r: p for r, (ok, p) in results.items() if not ok}
    if world_size > 1 and not codes and _same_verdict(world_size, errors):  # shown once: the verdict, then the line
        return _same_verdict_error(world_size, errors[0], note)
    how = _how_it_ended(codes)
    failures = {**errors, **{r: {"type": "died", "time": deaths.get(r) or 0.0, "message": ""} for r in codes}}
    first = first_failure(failures)
    others = {}
    for r in range(world_size):
        if r == first:
            continue
        if r in codes:
            others[r] = how[r] if first in codes else "then " + how[r]
        elif everyone or r in results:
            others[r] = describe(r, results, stacks, first)
    details = [f"  rank {r}: {s}" for r, s in others.items()]
    if first in codes:
        lines = details + (["", note] if note else [])
        return DistributedError(f"rank {first} died: it {how[first]}.", "\n".join(lines), rank=first,
                                exc_type="ProcessExit", exc_message=how[first], ranks={first: how[first], **others})
    e = errors[first]
    lines = [hide_cpp_frames_text(e["traceback"].rstrip()), "", "The other ranks:"] + details
    if note:
        lines += ["", note]
    return DistributedError(
        f"rank {first} failed with {e['type']}: {hide_cpp_frames_text(e['message'])}", "\n".join(lines),
        rank=first, exc_type=e["type"], exc_message=e["message"], rank_traceback=e["traceback"], ranks=others)


def timeout_error(world_size, results, stacks, timeout, note, backend=None):
    """``results`` is the snapshot taken when the time ran out: the ranks in it finished, the others are stuck."""
    finished = sorted(r for r, (ok, _) in results.items() if ok)
    failed = sorted(r for r, (ok, _) in results.items() if not ok)
    stuck = [r for r in range(world_size) if r not in results]
    lines = [f"{plural(finished)} finished." if finished else "No rank finished."]
    if failed:
        lines.append(f"{plural(failed)} raised an error.")
    states = {}
    for r in stuck:
        info = stacks.get(r, {})
        if info.get("where"):
            states[r] = f"stuck {info['where']}"
        elif info and not info.get("busy"):
            states[r] = "stuck until just after the timeout (it finished while the stacks were taken)"
        else:
            states[r] = "stuck (no Python stack)"
        lines.append(f"  rank {r}: {states[r]}")
    same = {}  # one stack, printed once for every rank that shares it
    for r in stuck:
        stack = stacks.get(r, {}).get("stack", "").rstrip()
        if stack:
            same.setdefault(stack, []).append(r)
    for stack, ranks in same.items():
        lines += ["", f"Python stack of {plural(ranks)} (most recent call last):", stack]
    if backend == "nccl" and stuck:
        lines += ["", "On NCCL a collective returns as soon as it is queued on the GPU: a rank waits where its "
                  "host first needs the result (t.item(), print(t), torch.cuda.synchronize()), so that line is "
                  "named, not the collective. TORCH_NCCL_TRACE_BUFFER_SIZE=2000 makes torch's flight recorder "
                  "keep the pending collectives, for torch.distributed's own timeout dump."]
    if note:
        lines += ["", note]
    return DistributedTimeout(
        f"{plural(stuck) if stuck else 'the ranks'} did not finish within {timeout:g} s "
        "(a rank skipped a collective, or is still computing: raise --timeout if so).",
        "\n".join(lines), ranks=states,
        stacks={r: stacks.get(r, {}).get("stack", "") for r in stuck if stacks.get(r, {}).get("stack")})


SERVER_GONE = "server gone"  # an exit code in dead_error: the rank's fork server ended first, and the rank with it


def _how_it_ended(codes):
    """rank -> how it ended, from ``codes`` (rank -> exit code; negative: killed by that signal; None: never
    reported; SERVER_GONE: its fork server ended first)."""
    return {r: ("ended with its fork server, which was stopped or killed"
                if c == SERVER_GONE else
                "ended, its exit code unknown (its parent never reported it)" if c is None else
                f"was killed by {signal_name(c)}" if c < 0 else f"exited with code {c}") for r, c in codes.items()}


def dead_error(codes, note):
    """The report of ranks that died between calls: the lowest one, then the others, each with how it ended."""
    return failure_error(max(codes) + 1, {}, {}, codes, {}, note, everyone=False)
