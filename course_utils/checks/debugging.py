"""Checker of 17_debugging_and_profiling: how much of a step is exposed communication (read from a profiler trace).
The mystery job's checker reads that run's dumps: course_utils.debugging.check_mystery_answer."""
import math

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
