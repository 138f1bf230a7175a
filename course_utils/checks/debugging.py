"""Checker of 17_debugging_and_profiling: how much of a step is exposed communication (read from a profiler trace).
``check_mystery_answer`` reads the mystery job's Flight Recorder dumps (course_utils.debugging runs the job and
reads them); ``odd_one_out`` there is the course's answer."""
import ast
import math

from course_utils.debugging import (_calls, _dumps_of, _first_difference, _groups, _ranks, _say, analyzer_named,
                                   read_dump)


def _event(name, tid, start_ms, end_ms):
    return {"ph": "X", "name": name, "tid": tid, "ts": 1_000_000.0 + 1e3 * start_ms, "dur": 1e3 * (end_ms - start_ms)}


def _trace(step, forward, backward, nodes, comms, extra=()):
    """A hand-made trace in milliseconds: the labelled ranges on thread 1, autograd nodes inside backward,
    gloo's all-reduces on threads 7 and 8."""
    events = [_event("step", 1, *step), _event("forward", 1, *forward), _event("backward", 1, *backward)]
    events += [_event("autograd::engine::evaluate_function: AddmmBackward0", 1, a, b) for a, b in nodes]
    events += [_event("gloo:all_reduce", tid, a, b) for tid, a, b in comms]
    events += [_event(name, tid, a, b) for name, tid, a, b in extra]
    return events


def _cases():
    """(what the trace shows, events, the exposed fraction of the step)."""
    return [
        ("two gloo threads whose all-reduces overlap each other, one ending after backward's last node",
         _trace((0, 100), (0, 20), (20, 70), [(20, 40), (40, 60)], [(7, 30, 50), (8, 45, 65), (7, 62, 80)]),
         0.20),
        ("every all-reduce hidden inside backward's compute",
         _trace((0, 50), (0, 10), (10, 45), [(10, 25), (25, 40)], [(7, 15, 22), (8, 26, 38)]), 0.0),
        ("all-reduces after backward's last node only, and one from the previous step before this step",
         _trace((0, 80), (0, 20), (20, 70), [(20, 50)], [(7, 55, 65), (8, 60, 75), (7, -30, -10)],
                extra=[("optimizer step", 1, 70, 80)]), 0.25),
    ]


def exposed_fraction_solution(events):
    """The course's solution: exposed communication / step time, from a trace's complete events."""
    by_name = lambda n: [e for e in events if e["name"] == n]
    step, backward = by_name("step")[0], by_name("backward")[0]
    s0, s1 = step["ts"], step["ts"] + step["dur"]
    b0 = backward["ts"]
    nodes = [e for e in events if e["tid"] == backward["tid"] and e["name"].startswith("autograd::engine::")
             and b0 <= e["ts"] <= b0 + backward["dur"]]
    c1 = max(e["ts"] + e["dur"] for e in nodes)
    merged = []
    for a, b in sorted((e["ts"], e["ts"] + e["dur"]) for e in by_name("gloo:all_reduce") if s0 <= e["ts"] <= s1):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    comm = sum(b - a for a, b in merged)
    hidden = sum(max(0.0, min(b, c1) - max(a, b0)) for a, b in merged)
    return (comm - hidden) / (s1 - s0)


def check_exposed_fraction(exposed_fraction, events=None):
    """``exposed_fraction(events)`` must return the fraction of the step (0 to 1) during which communication ran
    and backward's compute did not: hand-made traces first, then ``events`` (a real trace), against the course's
    solution within 0.01. Raises ``AssertionError`` with the first case it gets wrong."""
    cases = _cases()
    if events is not None:
        cases.append(("this lesson's profiled DDP step", events, exposed_fraction_solution(events)))
    for what, trace, want in cases:
        try:
            got = exposed_fraction([dict(e) for e in trace])
        except NotImplementedError:
            raise AssertionError("exposed_fraction is not written yet (it raised NotImplementedError): write it "
                                 "above, then run the cell again") from None
        if got is None or not isinstance(got, (int, float)) or isinstance(got, bool) or math.isnan(got):
            raise AssertionError(f"exposed_fraction should return a number between 0 and 1, got {got!r}")
        if not 0.0 <= got <= 1.0:
            raise AssertionError(f"for a trace with {what}, exposed_fraction returned {got:.3f}: a fraction of "
                                 "the step lies between 0 and 1 (are the microseconds divided by the step's?)")
        if abs(got - want) > 0.01:
            hint = ("count time in which two all-reduces overlap once: merge the intervals first; "
                    "compute ends with backward's last autograd node, not with 'backward' (DDP waits for the "
                    "last all-reduces inside it); only events inside the step count; and divide by the step's "
                    "duration, not by the communication's")
            raise AssertionError(f"for a trace with {what}, exposed_fraction returned {got:.3f}, but "
                                 f"{want:.3f} of the step is exposed communication. {hint}")
    print(f"check_exposed_fraction: right on {len(cases)} traces "
          f"({len(cases) - 1 if events is not None else len(cases)} hand-made"
          + (", and this lesson's profiled step)." if events is not None else ")."))


# -- the mystery job: who left the others, and where ------------------------------------------------------------
def check_mystery_answer(job, culprit_rank, collective_number):
    """The mystery job of 17_debugging_and_profiling hung: which rank left the others (``culprit_rank``), and at
    which collective number (``collective_number``, the '#' of ``dump_table``)? Read from ``job``'s own Flight
    Recorder dumps, so that each hint says what this run recorded. Raises ``AssertionError`` with a hint when the
    answer is wrong; prints one line when it is right."""
    __tracebackhide__ = True  # noqa: F841 (read by IPython and pytest)
    if culprit_rank is None or collective_number is None:
        raise AssertionError("not answered yet: set culprit_rank (an int) and collective_number (the '#' of "
                             "dump_table's row where that rank left the others) from what the dumps say, then run "
                             "the cell again")
    calls = _calls(job)
    config = next(iter(read_dump(next(iter(_dumps_of(job).values())))["pg_config"].values()))
    world = len(ast.literal_eval(config["ranks"]))
    if sorted(calls) != list(range(world)):
        raise AssertionError(f"this run of the job left dumps from ranks {_ranks(calls) if calls else 'none'} of "
                             f"0 to {world - 1}: run the job's cell again, then this one")
    if isinstance(culprit_rank, bool) or not isinstance(culprit_rank, int):
        raise AssertionError(f"culprit_rank must be a rank number (an int from 0 to {world - 1}), "
                             f"not {culprit_rank!r}")
    if not 0 <= culprit_rank < world:
        raise AssertionError(f"the job had {world} ranks, 0 to {world - 1}; there is no rank {culprit_rank}")
    if isinstance(collective_number, bool) or not isinstance(collective_number, int):
        raise AssertionError(f"collective_number must be the '#' of one of dump_table's rows (an int), "
                             f"not {collective_number!r}")
    seqs = sorted({s for mine in calls.values() for s in mine})
    if collective_number not in seqs:
        raise AssertionError(f"the dumps number this job's collectives {seqs[0]} to {seqs[-1]}: no rank recorded "
                             f"a collective #{collective_number}")
    left = _first_difference(calls)
    stop = _first_difference(calls, key=lambda call: call[:2])
    if left is None or stop is None:
        raise AssertionError("in this run every rank made the same calls: the bug did not show; run the job's cell "
                             "again, then this one")
    seq, culprit, at = left
    stop_seq, _, stop_at = stop
    named = analyzer_named(job)
    if culprit_rank != culprit:
        twins = [r for r in calls if r != culprit_rank and calls[r] == calls[culprit_rank]]
        if twins:
            hint = (f"rank {culprit_rank} made the very calls rank{'s' if len(twins) > 1 else ''} {_ranks(twins)} "
                    "made, at every collective number (operation, sizes, and the line of the job that made each): "
                    "it did not leave them")
        else:
            same = [r for r, c in at.items() if c == at[culprit_rank] and r != culprit_rank]
            hint = (f"where the ranks' calls first differ, rank {culprit_rank} called {_say(at[culprit_rank])}"
                    + (f", as rank{'s' if len(same) > 1 else ''} {_ranks(same)} did" if same else "")
                    + f": rank {culprit} is the one whose call differs from the majority's there")
        if named is not None and culprit_rank in named[1]:
            hint += (f". fr_trace named rank{'s' if len(named[1]) > 1 else ''} {_ranks(named[1])} at #{named[0]} "
                     "in this run: it names each rank whose call differs from the first dump it reads, rank 0's "
                     "(torch 2.13's check_current_entry_match: 'Here we assume the current rank is not the source "
                     "of the error'); count which call most ranks made")
        raise AssertionError(hint)
    if collective_number != seq:
        if collective_number < seq:          # before the first difference, every rank made the same call
            agreed = next(iter(calls.values()))[collective_number]
            raise AssertionError(f"at #{collective_number} every rank called {_say(agreed)}: they still agreed "
                                 f"there; rank {culprit_rank} left the others at a later number")
        how = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}: {_say(c) if c else 'nothing'}"
                        for c, rs in _groups(stop_at))
        hint = (f"#{collective_number} is " + ("where the job stopped" if collective_number == stop_seq else
                                              f"after #{stop_seq}, where the job stopped")
                + f": at #{stop_seq} the calls differ in operation or size ({how}), so none of them could complete"
                + (f", and that is the number fr_trace reports in this run (#{named[0]})" if named and named[0] ==
                   stop_seq else "")
                + f". But rank {culprit_rank} had left the others before that: a call can match the others' by "
                "operation and size and still be another call of the job; compare the line of each rank's calls "
                "(dump_table(mystery, lines=True))")
        raise AssertionError(hint)
    others = [c for r, c in at.items() if r != culprit]
    print(f"check_mystery_answer: right: at #{seq} rank {culprit} called {_say(at[culprit])}, while the others "
          f"called {_say(others[0])}"
          + (f"; same operation and size, so the two matched and nothing failed until #{stop_seq}, where the calls "
             f"differ in operation or size" if stop_seq > seq else "; they could not match") + ". fr_trace reports "
          + (f"#{named[0]} and names rank{'s' if len(named[1]) > 1 else ''} {_ranks(named[1])}: where the job "
             "stopped, measured against rank 0's record, not where it went wrong." if named else "nothing here."))
