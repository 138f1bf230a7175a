"""The sentences a lesson prints after "Measured here:", each chosen from that run's numbers.

Introduced in 01_data_parallelism; each function's docstring names the lesson that prints it.

What these return depends on this machine's timings, so the notebooks print them after "Measured here:", a prefix
that tests/sanitize.cfg replaces: nbval checks that the cell runs, not what this machine measured. The wording is
held by the tests each section names. One section per lesson, in lesson order. The helpers these share with the
measuring code stay in its module (``bench``, ``ddp_probes``, ``debugging``) and are imported inside each function,
so that importing this module costs no torch and the measuring modules may import it without a cycle.
"""
import statistics


# -- 01_data_parallelism: what held data-parallel throughput back (tests/test_exercises_04_05.py) --------------------
def describe_throughput(world_sizes, samples_per_step, compute_s, comm_s, cores):
    """Two sentences on a data-parallel throughput measurement, chosen from its numbers. Introduced in
    01_data_parallelism: is compute per rank flat from the smallest to the largest world, and what held
    the throughput back (the shared cores, the all-reduce, or nothing)? The culprit is the part that added
    more time per step from the smallest to the largest world (by 1.5x; closer than that: both).

    ``compute_s`` and ``comm_s`` are seconds per step (the slowest rank's median) at each world size.
    """
    n0, n1 = world_sizes[0], world_sizes[-1]
    step_s = [a + b for a, b in zip(compute_s, comm_s)]
    growth = compute_s[-1] / compute_s[0]
    ideal = samples_per_step[-1] / samples_per_step[0]
    speedup = (samples_per_step[-1] / step_s[-1]) / (samples_per_step[0] / step_s[0])
    comm_share = comm_s[-1] / step_s[-1]
    span = f"from {n0} to {n1} ranks"
    if growth < 0.8:
        compute = (f"compute per rank shrank {span} (x{growth:.2f}), which the work cannot explain (every rank "
                   "does the same): other load on this machine disturbed the measurement.")
    elif growth < 1.25:
        compute = (f"compute per rank stayed flat {span} (x{growth:.2f}): each rank did the same work, as on one "
                   f"device per rank ({cores} cores here).")
    elif growth < 1.5:
        compute = (f"compute per rank grew a little {span} (x{growth:.2f}): {cores} core(s) for {n1} ranks, so "
                   "the ranks partly queued for the CPU.")
    else:
        compute = (f"compute per rank grew x{growth:.1f} {span}: {cores} core(s) for {n1} ranks, so the ranks "
                   "queued for the CPU; here they are not independent devices.")
    # What each part ADDED from the smallest to the largest world decides what held the throughput back.
    added_compute, added_comm = compute_s[-1] - compute_s[0], comm_s[-1] - comm_s[0]
    added = (f"compute added {added_compute * 1e3:.1f} ms per step, the all-reduce and step "
             f"{added_comm * 1e3:.1f} ms")
    if speedup > 1.1 * ideal:
        limit = f"more than the ideal x{ideal:g}: the {n0}-rank steps were disturbed by other work on this machine"
    elif speedup >= 0.75 * ideal:
        limit = f"close to the ideal x{ideal:g}"
    elif growth < 0.8:
        limit = "but the disturbed compute times make the ratio unreliable"
    elif added_compute > 1.5 * added_comm:
        limit = f"held back by the shared CPU cores (compute grew) more than by the all-reduce: {added}"
    elif added_comm > 1.5 * added_compute:
        limit = (f"held back by the all-reduce more than by compute: {added}"
                 + (" (compute stayed flat)" if growth < 1.25 else ""))
    else:
        limit = f"held back both by the shared CPU cores (compute grew) and by the all-reduce: {added}"
    share = (f"the all-reduce (and step) took {comm_share:.0%} of a {n1}-rank step; throughput at {n1} ranks is "
             f"x{speedup:.1f} that of {n0} rank{'s' if n0 > 1 else ''}, {limit}.")
    return [compute, share]


# -- 03_all_reduce_by_hand: how the two alpha-beta models fit a run (tests/test_bench.py) ----------------------------
MODEL_BAND = (1 / 1.5, 1.5)  # measured / model within this band: the model's scale is about right
MODEL_NAMES = {"dedicated": "dedicated-links model", "shared": "shared-link model"}


def describe_model_fit(agrees, n_sizes, ratios, cores, sizes=None):
    """Two lines on how 03_all_reduce_by_hand's two alpha-beta models fit a run, chosen from its numbers.

    ``agrees`` maps each model ("dedicated", "shared") to how many of the ``n_sizes`` sizes it ranked the
    algorithms as measured; ``ratios`` maps each model to {algorithm's short name: measured / that model's time,
    one per size}; ``cores`` is how many cores the ranks shared; ``sizes`` names the sizes ("16 KiB").
    Each algorithm is judged against the model that ranked the run as measured (against both when both or neither
    did), at each size on its own against ``MODEL_BAND`` (about 0.67x to 1.5x): within, above or below, so an
    algorithm within at one size and below at another is said to be so (a measurement on the model is never
    "below" it). Each side met gets one short reason. alpha and beta come from a ping-pong of Python
    ``send``/``recv`` over the same loopback, so Python's cost per message is in alpha already; what the 2-rank
    ping-pong did not see is 4 ranks at once. tests/test_bench.py holds it, with the runs that fooled it.
    Introduced in 03_all_reduce_by_hand.
    """
    if agrees["shared"] == n_sizes and agrees["dedicated"] < n_sizes:
        verdict = "this run ranks the algorithms as the shared-link model does (transfers queue for the same cores)."
    elif agrees["dedicated"] == n_sizes and agrees["shared"] < n_sizes:
        verdict = "this run ranks the algorithms as the dedicated-links model does (transfers ran side by side)."
    elif agrees["dedicated"] == agrees["shared"] == n_sizes:
        verdict = "both models rank the algorithms as this run measured them, at every size."
    else:
        verdict = ("neither model ranks the algorithms as measured at every size: this machine sits between one "
                   "shared link and dedicated links (and a busy machine's timings are noisy).")
    ranking = [links for links in ("shared", "dedicated") if agrees[links] == n_sizes]
    labels = list(sizes) if sizes else [f"size {k + 1}" for k in range(n_sizes)]
    lo_ok, hi_ok = MODEL_BAND
    reasons = {
        ("dedicated", "above"): f"the transfers queued for the same memory and {cores} core(s) instead of running "
                                "side by side",
        ("dedicated", "below"): "the other ranks' messages had often arrived before the busiest rank asked, so "
                                "their latencies overlapped",
        ("shared", "above"): (f"a message also waited for its receiver to get one of the {cores} core(s)"
                              if cores < 4 else "4 ranks copied through the same memory at once"),
        ("shared", "below"): f"some transfers overlapped ({cores} core(s) copy at once), as dedicated links would",
    }
    scales = []
    for links in ranking or ["shared", "dedicated"]:
        parts, met = [], []
        for name, rs in ratios[links].items():
            at = {}
            for label, r in zip(labels, rs):
                kind = "within" if lo_ok <= r <= hi_ok else "above" if r > hi_ok else "below"
                at.setdefault(kind, []).append(f"{label} ({r:.1f}x)")
                met += [kind] if kind not in met else []
            parts.append(f"{name} " + ", ".join(f"{kind} at {' and '.join(where)}" for kind, where in at.items()))
        scale = (f"measured / {MODEL_NAMES[links]} (within = {lo_ok:.2f}x to {hi_ok:.1f}x): " + "; ".join(parts) + ".")
        why = [f"{side}: {reasons[links, side]}" for side in ("above", "below") if side in met]
        scales.append(scale + (" " + "; ".join(why) + "." if why else ""))
    return [verdict, " ".join(scales)]   # two lines, whatever the outcome: the notebook prints each


# -- 04_measuring_bandwidth: the rings' race, bucketing, busbw across ops (tests/test_exercises_04_05.py) ------------
def _turns(row):
    """A row's per-turn times (a ``race`` row), or None for a plain ``sweep`` row (no spread measured)."""
    return row.get("turn_times_s")


def describe_race(rows, ring_rows, world_size=4, cores=None):
    """Sentences comparing two sweeps of the same sizes (the library's all-reduce, the hand ring), from the data.

    One sentence for the two smallest sizes, one for the two largest. At each size the winner is named only when
    the two functions' turns do not overlap (``spread_overlaps``: rows from ``race`` carry their turns); plain
    ``sweep`` rows (no turns) fall back to a 1.1x margin and say that no spread was measured. When both sizes of a
    pair have the same outcome the sentence names it once; otherwise it names the outcome of each size (a ring
    faster at one size and the difference within the spread at the other is said as such, never as "neither").
    Each winner comes with its reason: the fixed cost per call at the small sizes, and at the large ones how
    gloo's ring cuts the buffer (``gloo_ring_messages``: segments of at most 1 MiB) against the hand ring's
    2(n-1) messages of S/n. Introduced in 04_measuring_bandwidth.
    """
    from course_utils.bench import format_size, gloo_ring_messages, spread_overlaps

    if [r["bytes"] for r in rows] != [r["bytes"] for r in ring_rows]:
        raise ValueError("the two sweeps must have the same sizes")
    n = world_size
    names = [format_size(r["bytes"]) for r in rows]
    on_cores = f" on {cores} shared core(s)" if cores else " on shared cores"
    turns = rows[0].get("turns")
    spread = f"beyond the spread of {turns} turns" if turns else "no spread measured: a 1.1x margin"

    def outcome(k):
        lib, hand = rows[k], ring_rows[k]
        ratio = hand["time_s"] / lib["time_s"]   # > 1: the library is faster
        if _turns(lib) and _turns(hand):
            if spread_overlaps(_turns(lib), _turns(hand)):
                return ratio, "within"
        elif 1 / 1.1 <= ratio <= 1.1:
            return ratio, "within"
        return ratio, "library" if ratio > 1 else "hand"

    def why(kind, k, small):
        """The reason that fits a win by ``kind`` at size index ``k`` (the largest of its pair for the large)."""
        size = rows[k]["bytes"]
        msgs, seg = gloo_ring_messages(size, n)
        if kind == "library":
            return (" the hand ring's every step is a Python send or recv, gloo's ring runs in C++ on a worker thread"
                    if small else
                    f" the bytes dominate, and gloo's ring adds in C++ and overlaps sending one segment with adding "
                    f"another ({msgs} messages of {format_size(seg)} per rank at {names[k]})")
        return (f" not the algorithm: the time is almost all fixed cost per call, and dist.all_reduce hands the "
                f"work to a worker thread and back, and its ring sends {msgs} messages of {format_size(seg)} per "
                f"rank where the hand ring sends {2 * (n - 1)}"
                if small else
                f" gloo's ring cuts the buffer into segments of at most 1 MiB, to overlap sending one with adding "
                f"another, so at {names[k]} each rank sends {msgs} messages where the hand ring sends "
                f"{2 * (n - 1)} of {format_size(size // n)}; with {n} ranks{on_cores} every message costs "
                "wake-ups, and the overlap needs a free core")

    def span(values):
        return f"{min(values):.2f}x" if f"{min(values):.2f}" == f"{max(values):.2f}" else \
            f"{min(values):.2f}x to {max(values):.2f}x"

    def sentence(idx, small):
        found = [outcome(k) for k in idx]
        ratios = [r for r, _ in found]
        kinds = [kind for _, kind in found]
        where = f"at the {'smallest' if small else 'largest'} sizes ({names[idx[0]]}, {names[idx[1]]})"
        beyond = "beyond the measured spread" if turns else "by a 1.1x margin (no spread measured)"
        if kinds == ["library"] * len(idx):
            return f"{where} the library is faster ({span(ratios)}, {spread}):" + why("library", idx[-1], small)
        if kinds == ["hand"] * len(idx):
            key = idx[0] if small else idx[-1]
            return (f"{where} the hand ring is faster ({span([1 / r for r in ratios])}, {spread}):"
                    + why("hand", key, small))
        if kinds == ["within"] * len(idx):
            return (f"{where} neither ring is faster {beyond} at either size (time ratios, hand ring / library, "
                    f"{min(ratios):.2f} to {max(ratios):.2f}" + ("; the turns overlap at both)" if turns else ")"))
        parts = []   # the outcomes differ between the two sizes: one clause per size, each with its own verdict
        for k, (ratio, kind) in zip(idx, found):
            if kind == "library":
                parts.append(f"at {names[k]} the library is faster ({ratio:.2f}x, {spread}):" + why(kind, k, small))
            elif kind == "hand":
                parts.append(f"at {names[k]} the hand ring is faster ({1 / ratio:.2f}x, {spread}):"
                             + why(kind, k, small))
            else:
                parts.append(f"at {names[k]} neither ring is faster {beyond} (time ratio, hand ring / library, "
                             f"{ratio:.2f}" + ("; the turns overlap there)" if turns else ")"))
        return f"{where}, size by size: " + "; ".join(parts)

    return [sentence([0, 1], small=True), sentence([len(rows) - 2, len(rows) - 1], small=False)]


def describe_bucketing(took, alpha, beta, n_grads=64, grad_bytes=16 * 1024):
    """Two sentences on 04's bucketing race, chosen from its numbers: ``took`` maps "one_by_one" and "bucketed"
    to the seconds of each turn (``time_in_turns``); ``alpha`` and ``beta`` are section 4's fit.

    The first says whether bucketing was faster beyond the measured spread (the turns do not overlap); the second
    holds the measured ratio and each part against the alpha-beta model (as ratios: the model's times are
    exercise 2), and says when a measured time falls below alpha itself. Introduced in 04_measuring_bandwidth.
    """
    from course_utils.bench import spread_overlaps

    one, bucket = took["one_by_one"], took["bucketed"]
    m_one, m_bucket = statistics.median(one), statistics.median(bucket)
    speedup = m_one / m_bucket
    k = len(one)
    if spread_overlaps(one, bucket):
        first = (f"bucketing's gain ({speedup:.2f}x, medians of {k} turns) is within the measured spread: the turns "
                 "of the two overlap, so this run cannot tell them apart")
    elif m_one > m_bucket:
        first = (f"bucketing was {speedup:.1f}x faster (medians of {k} turns; in every turn the {n_grads} small "
                 "all-reduces took longer than the one bucket)")
    else:
        first = (f"bucketing was slower ({speedup:.2f}x, in every one of {k} turns): the copies into and out of "
                 f"the bucket cost more than the {n_grads - 1} fixed costs saved (a small alpha here, or a busy "
                 "machine)")
    model_one = n_grads * (alpha + beta * grad_bytes)
    model_bucket = alpha + beta * n_grads * grad_bytes
    parts = []
    for label, times, model in ((f"the {n_grads} all-reduces", one, model_one), ("the bucket", bucket, model_bucket)):
        inside = min(times) <= model <= max(times)
        parts.append(f"{label} took {statistics.median(times) / model:.2f}x the model's time"
                     + (" (the model lies within the turns' range)" if inside else ""))
    second = (f"the alpha-beta model of section 4 predicts bucketing {model_one / model_bucket:.1f}x faster, "
              f"measured {speedup:.1f}x; " + ", ".join(parts))
    if m_bucket < alpha:
        second += (f"; the bucket's median is below alpha itself ({m_bucket / alpha:.2f}x): alpha is a least-squares "
                   "fit to section 3's sweep, timed earlier under other load, not a floor that every all-reduce pays")
    return [first, second + "."]


def describe_busbw_spread(results, memcpy_Bps=None, world_size=4):
    """Sentences about busbw of several ops at one size: ``results`` maps op -> a ``sweep`` or ``race`` row.

    With ``race`` rows (their turns), reduce_scatter against all_reduce is weighed against the turns' spread;
    with ``memcpy_Bps`` (section 2's copy bandwidth), its extra time is held against what ProcessGroupGloo's
    clone of the input and copy of this rank's slice cost (S + S/n bytes copied), and the sentence says when the
    copies do not explain it (what does is then not known here). Introduced in 04_measuring_bandwidth.
    """
    from course_utils.bench import format_size, spread_overlaps

    bus = {op: r["busbw_Bps"] for op, r in results.items()}
    lo, hi = min(bus, key=bus.get), max(bus, key=bus.get)
    lines = [f"busbw spans {bus[hi] / bus[lo]:.1f}x, from {lo} (lowest) to {hi} (highest)"]
    if "reduce_scatter" not in results or "all_reduce" not in results:
        return lines
    rs, ar = results["reduce_scatter"], results["all_reduce"]
    turns_rs, turns_ar = _turns(rs), _turns(ar)
    spread = turns_rs is not None and turns_ar is not None
    within = spread and spread_overlaps(turns_rs, turns_ar)
    t = rs["time_s"] / ar["time_s"]
    if t > 1.25:
        how = "longer than the all-reduce itself"
    elif t >= 0.8:
        how = "about as long"
    elif t >= 0.6:
        how = "less, but more than the half that an optimal reduce-scatter, moving half the bytes, would take"
    else:
        how = "about half or less, as an optimal reduce-scatter, moving half the bytes, would take"
    if spread:
        how += (f"; the two ops' {len(turns_rs)} turns overlap: within the measured spread" if within else
                f"; beyond the spread of {len(turns_rs)} turns")
    lines.append(f"reduce_scatter took {t:.2f}x the time of all_reduce on the same buffer ({how})")
    ratio = bus["reduce_scatter"] / bus["all_reduce"]
    if ratio < 0.4:
        where = "below the 0.5 that a whole all-reduce and a slice would give: it costs even more than that"
    elif ratio <= 0.6:
        where = "near the 0.5 that a whole all-reduce and a slice give"
    elif ratio < 0.8:
        where = "between the 0.5 of a whole all-reduce and a slice and the 1 of a bandwidth-optimal reduce-scatter"
    else:
        where = "near the 1 of a bandwidth-optimal reduce-scatter: it moves no more than it must"
    if spread:
        k = ratio * rs["time_s"] / ar["time_s"]          # the bus factors' ratio: busbw ratio = k x t_ar / t_rs
        r_lo, r_hi = k * min(turns_ar) / max(turns_rs), k * max(turns_ar) / min(turns_rs)
        if r_lo <= 0.5 <= r_hi and not 0.4 <= ratio <= 0.6:
            where = ("away from the 0.5 that a whole all-reduce and a slice give, but within the measured spread of "
                     "it")
        where += (f" (the turns give {r_lo:.2f} to {r_hi:.2f}" + (", which includes 0.5)" if r_lo <= 0.5 <= r_hi
                                                                 else ")"))
    lines.append(f"reduce_scatter's busbw is {ratio:.2f}x all_reduce's, {where}")
    if memcpy_Bps:
        nbytes = rs["bytes"]
        copies = (nbytes + nbytes / world_size) / memcpy_Bps
        extra = rs["time_s"] - ar["time_s"]
        if spread:
            extra = statistics.median(turns_rs) - statistics.median(turns_ar)
        cost = (f"the clone and the slice copy {format_size(nbytes)} + 1/{world_size} of it, "
                f"{copies * 1e3:.2f} ms at section 2's copy bandwidth")
        if within:
            lines.append(f"reduce_scatter's extra time over all_reduce ({extra * 1e3:.1f} ms) is within the spread of "
                         f"the turns: this run cannot tell the copies from noise ({cost})")
        elif extra <= 0:
            lines.append(f"reduce_scatter came out {-extra * 1e3:.1f} ms faster than the all-reduce it runs inside "
                         "(a clone, a whole all-reduce, a slice): the load on this machine moved the two differently")
        elif extra <= 2 * copies:
            lines.append(f"reduce_scatter's extra time over all_reduce ({extra * 1e3:.1f} ms) is about what the copies "
                         f"cost: {cost}")
        else:
            lines.append(f"reduce_scatter's extra time over all_reduce ({extra * 1e3:.1f} ms) is {extra / copies:.0f}x "
                         f"what the copies cost ({cost}); what costs the rest is not known: this lesson does not "
                         "measure it (4 ranks copying at once on shared cores, each the slowest of 4, are slower than "
                         "one process alone, which is one suspect)")
    return lines


# -- 07_buckets_and_overlap: the bucket_cap_mb sweep and the timelines (tests/test_exercises_06_08.py) ---------------
def _ms(seconds):
    return f"{abs(seconds) * 1e3:.1f} ms"


def _against(cmp, other, base):
    """'with 7 buckets a step took 3.1 ms less than with one bucket, 5% of that step (faster in 13 of 16 rounds
    timed in turns)'."""
    share = f"{abs(cmp['saved_fraction']):.0%} of that step"
    if cmp["verdict"] == "faster":
        return (f"with {other} a step took {_ms(cmp['saved_s'])} less than with {base}, {share} (faster in "
                f"{cmp['won']} of {cmp['rounds']} rounds timed in turns)")
    if cmp["verdict"] == "slower":
        return (f"with {other} a step took {_ms(cmp['saved_s'])} longer than with {base}, {share} (slower in "
                f"{cmp['rounds'] - cmp['won']} of {cmp['rounds']} rounds timed in turns)")
    return (f"no measurable difference between {other} and {base}: {other} was faster in {cmp['won']} of "
            f"{cmp['rounds']} rounds timed in turns (its typical step {_ms(cmp['saved_s'])} "
            f"{'shorter' if cmp['saved_s'] >= 0 else 'longer'})")


def describe_cap_sweep(caps, buckets, seconds):
    """One sentence on lesson 07's ``bucket_cap_mb`` sweep, chosen from its numbers: which cap was fastest, and
    whether overlapping (several buckets) measurably paid against one bucket, which overlaps nothing. ``seconds``
    holds, per cap, the step times of the rounds in which every cap took one step in turn; speed is the time saved
    per step against one bucket (``compare_in_turns``). Introduced in 07_buckets_and_overlap."""
    from course_utils.ddp_probes import compare_in_turns, typical_time

    one = buckets.index(1)
    typical = [typical_time(ts) for ts in seconds]
    fastest = min(range(len(caps)), key=lambda i: typical[i])
    name = lambda i: f"bucket_cap_mb={caps[i]:g} ({buckets[i]} bucket{'s' if buckets[i] > 1 else ''})"
    cmps = {i: compare_in_turns(seconds[one], seconds[i]) for i in range(len(caps)) if i != one}
    base = f"one bucket (bucket_cap_mb={caps[one]:g}, no overlap)"
    faster = [i for i, c in cmps.items() if c["verdict"] == "faster"]
    slower = [i for i, c in cmps.items() if c["verdict"] == "slower"]
    if faster:
        best = max(faster, key=lambda i: cmps[i]["saved_s"])
        return (f"the fastest was {name(best)}: " + _against(cmps[best], f"{buckets[best]} buckets", base) +
                ": overlapping the all-reduces with backward paid more than the extra messages cost.")
    if slower:
        worst = min(slower, key=lambda i: cmps[i]["saved_s"])
        return (f"one bucket (bucket_cap_mb={caps[one]:g}), which overlaps nothing, was not beaten: "
                + _against(cmps[worst], f"{buckets[worst]} buckets", "one bucket") +
                ": on these shared cores the all-reduces running during backward, and the extra messages, cost more "
                "than overlap saved.")
    return (f"no cap was measurably faster or slower than one bucket (bucket_cap_mb={caps[one]:g}) in "
            f"{len(seconds[one])} rounds timed in turns (the typical step was shortest with {name(fastest)}, but no "
            "cap won or lost 3 rounds in 4 against one bucket): on this machine overlap neither paid nor cost "
            "measurably.")


_PART_NAMES = {"compute": "backward's compute", "exposed": "the exposed communication",
               "rest": "the rest after the last gradient"}


def describe_overlap(one, many, many_label="7 buckets", one_label="one bucket"):
    """One sentence on lesson 07's timelines, chosen from their numbers: is the step with ``many`` buckets faster
    than with one, and which part of the step made the difference. ``one`` and ``many`` are lists of ``step_parts``
    dicts timed in turns; the reason is read from the typical steps' parts, which add up (``typical_step``), never
    from medians that do not. Introduced in 07_buckets_and_overlap."""
    from course_utils.ddp_probes import compare_in_turns, typical_step

    cmp = compare_in_turns([s["total"] for s in one], [s["total"] for s in many])
    t_one, t_many = typical_step(one), typical_step(many)
    delta = {k: t_many[k] - t_one[k] for k in ("compute", "exposed", "rest")}
    parts = ", ".join(f"{_PART_NAMES[k]} {'+' if d >= 0 else '-'}{_ms(d)}" for k, d in delta.items())
    text = _against(cmp, many_label, one_label) + f". Per typical step (its parts add up): {parts}"
    if cmp["verdict"] == "faster":
        main = min(delta, key=delta.get)
        if main == "exposed":
            return text + (": overlap paid, the communication it hid was worth more than backward's compute grew."
                           if delta["compute"] > 0 else ": overlap paid, the communication it hid is the saving.")
        return text + f": the saving is in {_PART_NAMES[main]}, not in the hidden communication."
    if cmp["verdict"] == "slower":
        main = max(delta, key=delta.get)
        if main == "compute":
            hid = (f"more than overlap took off the exposed communication ({_ms(delta['exposed'])})"
                   if delta["exposed"] < 0 else "and overlap took nothing off the exposed communication")
            return text + (f": backward's compute grew by {_ms(delta['compute'])} with the bucket all-reduces and "
                           f"their hooks running beside it, {hid}.")
        if main == "exposed":
            return text + (": more communication was left after backward: every message pays its latency, and the "
                           "last buckets queue behind the earlier ones.")
        return text + ": the step grew after the last gradient, outside the communication the hooks recorded."
    return text + "."


def describe_agreement(sweep, timeline):
    """One sentence: do section 3's sweep and section 4's timelines of lesson 07, two cells that time the same two
    bucket layouts, each in its own turns, agree? ``sweep`` and ``timeline`` are ``compare_in_turns`` results
    (several buckets against one). Introduced in 07_buckets_and_overlap."""
    def short(cmp):
        if cmp["verdict"] == "no measurable difference":
            return (f"no measurable difference (a typical step {_ms(cmp['saved_s'])} "
                    f"{'shorter' if cmp['saved_s'] >= 0 else 'longer'}, faster in {cmp['won']} of {cmp['rounds']})")
        return f"{cmp['verdict']} by {_ms(cmp['saved_s'])} per step"

    a, b = sweep["verdict"], timeline["verdict"]
    figures = (f"with 7 buckets against one, the sweep of section 3 (forward included) found {short(sweep)}, these "
               f"timelines found {short(timeline)}")
    if a == b:
        return f"the two cells agree: {figures} for the same two layouts."
    if "no measurable difference" in (a, b):
        return (f"the two cells half agree: {figures}; an effect that one cell measures and the other does not is "
                "near this machine's noise.")
    return (f"the two cells disagree: {figures}; the difference between the layouts is smaller than what the load "
            "on this machine changes from one cell to the next, so neither figure is a property of the layouts.")


def describe_compute_growth(sim_growth, real_growth, noise=0.1):
    """One sentence comparing how much backward's compute grew with several buckets against one, on lesson 07's
    simulated link (no transfer work, and no thread: the link is a schedule its hook computes) and on the real gloo
    run: ``sim_growth`` and ``real_growth`` are the ratios
    of the typical steps' compute. Growths within ``noise`` (0.1: 10 points) of each other count as equal.
    Introduced in 07_buckets_and_overlap."""
    text = (f"backward's compute with 7 buckets against one: x{sim_growth:.2f} on the simulated link (no transfer "
            f"work, no thread), x{real_growth:.2f} on the real gloo run")
    if max(sim_growth, real_growth) <= 1 + noise:
        return text + f": neither grew by more than the noise ({noise:.0%})."
    if real_growth > sim_growth + noise:
        return text + (": the real run's compute grew more, and that difference is the share of backward's cores "
                       "that gloo's transfers took.")
    if sim_growth > real_growth + noise:
        return text + (": the simulated link's grew more, with no transfer at all, so this run shows no cost of "
                       "gloo's transfers to backward; the growth came from what the runs share (the hook calls) and "
                       "from this machine's load, which changed between the two cells.")
    return text + (": about as much, with no transfer and no thread on the simulated link, so the growth is not "
                   "gloo's work but what both runs share (the hook calls, this machine's load).")


# -- 09_compression: torch's powerSGD_hook with several buckets on gloo (tests/test_micro_ddp.py) --------------------
def describe_gloo_failure(error, rank_logs, deadline_s):
    """What became of a run that can deadlock or mismatch its collectives, in one line for "Measured here:".

    ``error``: what ``Cluster.run`` raised (None if the run finished); ``rank_logs``: each rank's stderr (what gloo
    prints before it aborts a process) as text, by rank; ``deadline_s``: the run's timeout. Which failure happens
    depends on how the ranks' threads were scheduled, so the sentence is chosen from the outcome.
    Introduced in 09_compression."""
    from course_utils.engine.reports import DistributedTimeout

    if error is None:
        return ("the run finished: this time the ranks' gloo threads happened to issue the collectives in the same "
                "order (run it again).")
    if isinstance(error, DistributedTimeout):
        return (f"both ranks hung in `backward()`, each waiting in a collective the other never joined (a deadlock), "
                f"until the run's {deadline_s:.0f} s deadline released them.")
    mismatch = sorted(r for r, text in rank_logs.items() if "doesn't match expected size" in text)
    if mismatch:
        return (f"gloo aborted rank {mismatch[0]}: \"Received data size doesn't match expected size. Is there a "
                "distributed collective mismatch in your code?\": the ranks' n-th collectives were different "
                "all-reduces.")
    return "a rank failed: " + str(error).splitlines()[0]


# -- 13_fsdp_by_hand: what prefetch did (tests/test_micro_fsdp.py) ---------------------------------------------------
def describe_prefetch(no_prefetch, prefetch):
    """What prefetch did to forward + backward in a ``race_fully_shard`` run, as a sentence chosen from its numbers.

    Introduced in 13_fsdp_by_hand. ``no_prefetch``, ``prefetch``: the ``step_seconds`` of "MicroFSDP, no prefetch"
    and "MicroFSDP" (step i of both ran in the same round, one after the other, so a busy moment slows both).
    Prefetch is said to save (or cost) time only when it was faster (or slower) in every round, by 5 % or more of
    forward + backward; otherwise the sentence gives the spread the difference is lost in."""
    def fb(s):
        return 1e3 * (s["forward"] + s["backward"])

    gains = [fb(a) - fb(b) for a, b in zip(no_prefetch, prefetch)]          # ms saved by prefetch, round by round
    n, faster = len(gains), sum(g > 0 for g in gains)
    gain = statistics.median(gains)
    share = gain / statistics.median(fb(a) for a in no_prefetch)
    spread = max(max(fb(s) for s in steps) - min(fb(s) for s in steps) for steps in (no_prefetch, prefetch))
    why = ("on gloo a gather is a copy through memory that competes with the compute for the same cores, so "
           "little of it can hide")
    if faster == n and share >= 0.05:
        return (f"prefetch saved {gain:.1f} ms of forward + backward ({share:.0%}, median), and was faster in each "
                f"of the {n} rounds: gathers hidden behind compute.")
    if faster == 0 and -share >= 0.05:
        return (f"prefetch cost {-gain:.1f} ms of forward + backward ({-share:.0%}, median), and was slower in each "
                f"of the {n} rounds: {why}, and starting it early only adds work beside the compute.")
    return (f"prefetch was faster in {faster} of {n} rounds (median {-gain:+.1f} ms of forward + backward, "
            f"{-share:+.0%}; the same configuration's steps varied by up to {spread:.1f} ms): no difference this run "
            f"can tell from its noise. {why[0].upper() + why[1:]}.")


# -- 17_debugging_and_profiling: DETAIL's cost, overlap, communication share (tests/test_debugging.py) ---------------
def describe_detail_cost(plain, detail, collectives_per_step=2, noise=1.2):
    """The sentence after "Measured here:" for what TORCH_DISTRIBUTED_DEBUG=DETAIL costs lesson 17's healthy job:
    ``plain`` and ``detail`` are ``{rank: [seconds of each step]}`` (``Job.step_seconds``) of the same job without
    and with DETAIL. Compares the medians over every rank's steps; a ratio under ``noise`` is called this machine's
    noise, not a cost (two short jobs at once on a busy machine can swap places). Introduced in
    17_debugging_and_profiling."""
    p = statistics.median(s for steps in plain.values() for s in steps)
    d = statistics.median(s for steps in detail.values() for s in steps)
    head = (f"a healthy step ({collectives_per_step} all-reduces) took {1e3 * p:.1f} ms plain and {1e3 * d:.1f} ms "
            "with DETAIL (medians over both ranks' steps)")
    if d >= noise * p:
        extra = 1e3 * (d - p) / collectives_per_step
        return (f"{head}: DETAIL made it {d / p:.1f}x slower, about {extra:.1f} ms more per collective for the "
                "checks it runs before each one.")
    if p >= noise * d:
        return (f"{head}: the plain steps were {p / d:.1f}x slower, so this machine's load, not DETAIL, set these "
                "times (the two jobs ran at once; run it again, or alone, to see DETAIL's cost).")
    return (f"{head}: within {noise}x of each other, so this run cannot tell DETAIL's checks from this machine's "
            "noise (its per-collective cost is a few small messages on loopback; run it again, or alone).")


def describe_hidden_fractions(hand, traced, extra, band=0.25):
    """The sentence after "Measured here:" for lesson 17's two measures of overlap: ``hand[r]`` and ``traced[r]``
    are rank r's hidden fractions over the profiled steps, from lesson 07's hand-made timeline (each all-reduce
    from its launch in the comm hook to its callback) and from the trace (gloo's own run of each all-reduce);
    ``extra[r]`` is rank r's ``hand_made_extra`` ``waited`` and ``after`` lists over the same steps, joined. Compares
    the medians per rank against ``band``; where they differ by more, it gives the measured reason: how long the
    hand-made intervals ran before gloo started each all-reduce (queued) and after it finished, the time the
    trace does not count. The sentence carries the numbers it rests on. Introduced in 17_debugging_and_profiling."""
    parts, gaps = [], []
    for r in range(len(hand)):
        h, t = statistics.median(hand[r]), statistics.median(traced[r])
        parts.append(f"rank {r} hid {t:.2f} of its communication behind backward by the trace, {h:.2f} by the "
                     f"hand-made timeline")
        if abs(h - t) <= band:
            continue
        waited, after = (1e3 * statistics.median(extra[r][k]) for k in ("waited", "after"))
        gaps.append(f"rank {r}'s hand-made figure is {abs(h - t):.2f} {'lower' if h < t else 'higher'}: its "
                    f"intervals began a median {waited:.1f} ms before gloo ran each all-reduce (queued behind "
                    f"another bucket) and ended {after:.1f} ms after it, time the trace does not count")
    verdict = f"the two agree within {band} on every rank" if not gaps else "; ".join(gaps)
    return "; ".join(parts) + f". {verdict[0].upper()}{verdict[1:]}."


def describe_communication_share(ddp_events, fsdp_events, close=0.05):
    """The sentence after "Measured here:" for lesson 17's DDP and FSDP2 steps profiled side by side: the share of
    each step during which a collective ran, and which is larger (within ``close``, neither), with the collectives'
    summed run time to tell "more communication" from "communication that ran more at once". Introduced in
    17_debugging_and_profiling."""
    from course_utils.debugging import communication_share

    ddp, fsdp = communication_share(ddp_events), communication_share(fsdp_events)

    def summed_ms(events):
        return sum(e["dur"] for e in events if e["name"].startswith(("gloo:", "nccl:"))) / 1e3

    d_ms, f_ms = summed_ms(ddp_events), summed_ms(fsdp_events)
    head = (f"a collective ran during {ddp:.0%} of DDP's step and {fsdp:.0%} of FSDP2's (their run times add up to "
            f"{d_ms:.1f} and {f_ms:.1f} ms)")
    if abs(fsdp - ddp) <= close:
        return f"{head}: about the same share of the step here."
    larger, smaller = ("FSDP2", "DDP") if fsdp > ddp else ("DDP", "FSDP2")
    more_time = (f_ms > d_ms) == (fsdp > ddp)
    why = ("its collectives also ran longer in all" if more_time else
           f"although {smaller}'s collectives ran longer in all: more of them ran at once, on gloo's two threads")
    return f"{head}: {larger}'s share is the larger here, {why}."
