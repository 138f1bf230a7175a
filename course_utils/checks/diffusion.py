"""The self-check of 18_diffusion_on_two_rtx_3060s's exercise: the largest micro-batch that fits a card.

The learner writes ``largest_micro_batch(peak_at_1, peak_at_4, card_gib, usable=0.85)``: the peak per card is
linear in the micro-batch (the state does not grow with it; each sample adds its activations), so two measured
points give the line, and the answer is the largest whole micro-batch under ``usable`` of the card (0 when not
even one fits). The checker runs it on cases whose answers separate the typical mistakes.
"""
import math

from course_utils.diffusion import solution_largest_micro_batch

GiB = 2 ** 30

# (peak at micro-batch 1, peak at micro-batch 4, card GiB): the answers differ for each mistake named below.
CASES = (
    (7.30 * GiB, 9.00 * GiB, 12),       # SD 1.5-like: a few samples fit
    (3.10 * GiB, 3.90 * GiB, 12),       # room for many: the floor, not a rounding, decides
    (9.00 * GiB, 11.40 * GiB, 12),      # only one fits
    (10.90 * GiB, 12.50 * GiB, 12),     # not even one: 0
    (5.00 * GiB, 8.60 * GiB, 24),       # another card
)


def _mistakes(peak_at_1, peak_at_4, card_gib, usable):
    """What each typical mistake returns on one case."""
    per = (peak_at_4 - peak_at_1) / 3
    fixed = peak_at_1 - per
    budget = usable * card_gib * GiB
    return {
        "GB": max(0, math.floor((usable * card_gib * 1e9 - fixed) / per)),
        "no margin": max(0, math.floor((card_gib * GiB - fixed) / per)),
        "rounded": max(0, round((budget - fixed) / per)),
        "proportional": max(0, math.floor(budget / peak_at_1)),
        "per sample from 4": max(0, math.floor(budget / (peak_at_4 / 4))),
        "negative": math.floor((budget - fixed) / per),
    }


HINTS = {
    "GB": "a card's \"12 GB\" is 12 GiB (nvidia-smi shows 12288MiB): multiply by 2**30, not 1e9",
    "no margin": "only `usable` of the card is for tensors (the rest is the CUDA context, the allocator's cache, "
                 "NCCL): the budget is usable * card_gib * 2**30",
    "rounded": "a micro-batch fits only when its whole peak is under the budget: round down (math.floor), not to "
               "the nearest",
    "proportional": "the peak is not proportional to the micro-batch: the weights, gradients and AdamW state are "
                    "there at any batch. Take the line through the two points: per sample = (peak_at_4 - "
                    "peak_at_1) / 3, fixed = peak_at_1 - per sample",
    "per sample from 4": "peak_at_4 / 4 is not a sample's share: most of the peak is the state, which does not grow "
                         "with the batch. Per sample = (peak_at_4 - peak_at_1) / 3",
    "negative": "when not even one sample fits, the answer is 0, not a negative number",
}


def check_largest_micro_batch(fn, usable=0.85):
    """Lesson 18's exercise: ``fn(peak_at_1, peak_at_4, card_gib, usable)`` returns the largest micro-batch that fits.
    Passes quietly (returns a one-line explanation) when ``fn`` agrees with the course on every case; otherwise
    an ``AssertionError`` saying which case and what the answer's mistake looks like."""
    got, right = [], []
    for peak_at_1, peak_at_4, card_gib in CASES:
        where = (f"largest_micro_batch({peak_at_1 / GiB:.2f} GiB, {peak_at_4 / GiB:.2f} GiB, card_gib={card_gib}, "
                 f"usable={usable})")
        try:
            value = fn(peak_at_1, peak_at_4, card_gib, usable)
        except NotImplementedError:
            raise AssertionError("largest_micro_batch still raises NotImplementedError: write it (the peak is a line "
                                 "through the two measured points; find the largest whole batch under the "
                                 "budget), then set USE_SOLUTION = False") from None
        whole = isinstance(value, int) or isinstance(value, float) and value.is_integer()
        if isinstance(value, bool) or not whole:
            raise AssertionError(f"{where} returned {value!r}: return a whole number of samples (an int)")
        got.append(int(value))
        right.append(solution_largest_micro_batch(peak_at_1, peak_at_4, card_gib, usable))
    if got == right:
        return (f"right on all {len(CASES)} cases: the state is paid once, the activations once per sample, and "
                "the budget is the usable share of the card in GiB")
    # the mistake whose answers are the learner's on every case (each differs from the course's on some case)
    for mistake in HINTS:
        if got == [_mistakes(*case, usable)[mistake] for case in CASES]:
            hint = HINTS[mistake]
            break
    else:
        hint = ("the peak at micro-batch b is fixed + b * per sample; the answer is the largest b with that peak "
                "<= usable * card_gib GiB")
    i = next(k for k in range(len(CASES)) if got[k] != right[k])
    peak_at_1, peak_at_4, card_gib = CASES[i]
    raise AssertionError(f"largest_micro_batch({peak_at_1 / GiB:.2f} GiB, {peak_at_4 / GiB:.2f} GiB, "
                         f"card_gib={card_gib}, usable={usable}) returned {got[i]}, the course finds {right[i]}: "
                         f"{hint}")
