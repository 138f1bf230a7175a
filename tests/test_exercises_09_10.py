"""The exercises of 09_compression and 10_tradeoffs (09's exercise 2 has its own module,
tests/test_checker_tightest_rtol.py): each self-check rejects the unmodified scaffold
and typical wrong answers with a reason a learner can act on, and accepts the course's solution.

The exercise cells are taken from the notebooks themselves (found by a marker in their source), with
``USE_SOLUTION = False`` and the learner's lines replaced by each answer, and run where the notebook
runs them: on 2 gloo ranks (``%%ddp`` cells) or in this process.

    .venv/bin/python -m pytest tests/test_exercises_09_10.py -p no:randomly
"""
import pytest

from course_utils import costmodel, hooks
from course_utils.checks import tradeoffs
from course_utils.checks.comm_hook import check_fp16_powersgd_bytes
from course_utils.costmodel import Calibration
from exercise_helpers import notebook_cell, solution_off


def learner(source, **replacements):
    """``source`` with USE_SOLUTION switched off and each ``old=new`` line replacement applied."""
    source = solution_off(source)
    for old, new in replacements.values():
        assert old in source, f"{old!r} not in the exercise cell"
        source = source.replace(old, new, 1)
    return source


@pytest.fixture(scope="module")
def cluster(make_cluster):
    return make_cluster(2, timeout=120)


# -- 10_tradeoffs, exercise 1: the smallest accum_steps with exposed communication below 10% ----------
CAL = Calibration(alpha=50e-6, beta=1 / 1e9, flop_rate=2e10, overhead=2e-4, update_per_param=1e-9, world_size=2)
PARAMS = 528_385


def run_exercise_1(answer_line):
    source = notebook_cell("10_tradeoffs.ipynb", "check_accum_steps", ddp_line=False)
    if answer_line is not None:
        source = learner(source, answer=("answer = None", answer_line))
    exec(compile(source, "exercise_1", "exec"), {"costmodel": costmodel, "cal": CAL, "n_params": PARAMS})


def test_10_exercise_1_solution_passes():
    k = tradeoffs.smallest_accum_steps(CAL, world_size=8, params=PARAMS, micro_batch=4)
    assert k >= 3, "the test needs an answer with two smaller wrong ones"
    run_exercise_1(None)  # the stored notebook: USE_SOLUTION = True
    run_exercise_1(f"answer = {k}")


@pytest.mark.parametrize("answer, reason", [
    ("None", "answer is None: set it"),
    ("1", "not below 10%"),
    ("K - 1", "try a larger value"),          # off by one, too small
    ("K + 1", "the question asks for the smallest"),   # off by one, too large
    ("K * 1.0", "a whole number"),
    ("0", "a whole number >= 1"),
])
def test_10_exercise_1_wrong_answers_fail_with_a_reason(answer, reason):
    k = tradeoffs.smallest_accum_steps(CAL, world_size=8, params=PARAMS, micro_batch=4)
    with pytest.raises(AssertionError, match=reason):
        run_exercise_1(f"answer = {answer.replace('K', str(k))}")


def test_10_exercise_1_model_is_monotone_so_the_smallest_is_well_defined():
    shares = [costmodel.predict(CAL, world_size=8, params=PARAMS, micro_batch=4, accum_steps=k).comm_share
              for k in range(1, 50)]
    assert all(a > b for a, b in zip(shares, shares[1:]))


# 10_tradeoffs exercise 2 (unequal shares, check_weighted_sync): tests/test_checker_weighted_sync.py


# -- 09_compression, exercise 1: bytes of fp16_compress_wrapper(powerSGD_hook) at rank 1 -------------------
# The ranks measure (a %%ddp cell); the notebook process checks the prediction, so a wrong answer raises
# in the notebook, not on ranks whose PowerSGD callbacks ran on gloo's threads.
def measure_09(cluster):
    cluster.run(notebook_cell("09_compression.ipynb", "def grad_error", ddp_line=False))
    cluster.run("from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook")
    cluster.run(notebook_cell("09_compression.ipynb", "fp16_psgd_bytes = ", ddp_line=False))


def run_09_exercise_1(cluster, answer_line):
    from course_utils.models import make_model

    source = notebook_cell("09_compression.ipynb", "check_fp16_powersgd_bytes", ddp_line=False)
    if answer_line is not None:
        source = learner(source, answer=("predicted_bytes = None", answer_line))
    exec(compile(source, "exercise_1", "exec"),
         {"hooks": hooks, "make_model": make_model, "get_cluster": lambda: cluster})


def test_09_exercise_1_solution_passes(cluster, capsys):
    measure_09(cluster)
    run_09_exercise_1(cluster, None)
    run_09_exercise_1(cluster, "predicted_bytes = 2 * (257 + (128 + 32) * 1)")
    out = capsys.readouterr().out
    assert "exercise 1: the course's answer passed" in out and "exercise 1: right" in out, out
    assert "834" not in out, "the stored output must not give the answer away"


@pytest.mark.parametrize("answer, reason", [
    ("None", "predicted_bytes is None"),
    ("4 * (257 + 160)", "PowerSGD's count in float32"),      # forgot the wrapper's cast
    ("2 * 4353", "the whole gradient in float16"),           # forgot PowerSGD
    ("2 * 160", "you counted P and Q only"),                 # forgot the uncompressed tensors
    ("900", "Count the numbers PowerSGD all-reduces"),
    ("834.0", "a whole number of bytes"),
])
def test_09_exercise_1_wrong_answers_fail_with_a_reason(cluster, answer, reason):
    if cluster.run("'fp16_psgd_bytes' in globals()") != [True, True]:
        measure_09(cluster)
    with pytest.raises(AssertionError, match=reason):
        run_09_exercise_1(cluster, f"predicted_bytes = {answer}")


def test_09_exercise_1_checker_notices_a_wrong_measurement():
    from course_utils.models import make_model

    with pytest.raises(AssertionError, match="the counter measured 1668 bytes"):
        check_fp16_powersgd_bytes(834, 1668, make_model(0, d_in=32, d_hidden=128))


def test_10_world_size_slider_takes_powers_of_two_and_labels_do_not_collide():
    """Issue 23: the slider offered 96 (x labels "96128"); now powers of two only, and the efficiency panel's
    ticks stay the powers of two even when plot_model is given another world size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cal = Calibration(alpha=50e-6, beta=1e-9, flop_rate=1e10, world_size=2)
    panel = costmodel.cost_model_widget(cal, world_size=2, params=5e5, micro_batch=16)
    options = list(panel.sliders["world_size"].options)
    assert options == [1, 2, 4, 8, 16, 32, 64, 128], options
    fig = plt.figure()
    costmodel.draw_model(fig, cal, world_size=96, params=5e5, micro_batch=16, accum_steps=1)
    ticks = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    plt.close(fig)
    assert "96" not in ticks and ticks == [str(w) for w in costmodel.WORLD_SIZES], ticks
