"""Checkers that explain in plain words what is wrong. Each lives in its own module:

- ``check_sum_of_squares`` (00_launcher_tour), in ``checks.tour``
- ``check_activation_predictions``, ``check_optimizer_state_predictions`` (01_data_parallelism) and
  ``check_all_reduce_in_two_halves``, ``check_ring_shift``, ``check_gather_to_rank0``
  (02_collectives_sandbox), in ``checks.basics``
- ``check_all_reduce``, ``check_sent_bytes_prediction`` (03_all_reduce_by_hand), in ``checks.all_reduce``
- ``check_busbw``, ``check_bucket_times``, ``check_algbw_prediction`` (04_measuring_bandwidth), in
  ``checks.bandwidth``
- ``check_grad_averaging``, ``check_adam_hides_the_bug`` (05_manual_gradient_averaging), in ``checks.grad_avg``
- ``check_sync_prediction``, ``check_accumulate`` (06_ddp_accumulation_no_sync), in ``checks.accumulation``
- ``check_rebuilt_buckets``, ``check_bucket0_prediction`` (07_buckets_and_overlap), in ``checks.buckets``
- ``check_comm_hook`` (08_comm_hooks), in ``checks.comm_hook``
- ``check_accum_steps``, ``check_weighted_sync`` (10_tradeoffs), in ``checks.tradeoffs``
- ``check_broadcast_state``, ``check_assign_buckets``, ``check_start_allreduce``, ``check_micro_ddp``,
  ``check_compressor``, ``check_late_flag`` (11_capstone_micro_ddp), in ``checks.micro_ddp``
- the checkers of 12_zero_fsdp, in ``checks.zero``
- ``check_pad_and_shard``, ``check_micro_fsdp`` (13_fsdp_by_hand), in ``checks.fsdp``
- ``check_row_parallel_backward``, ``check_pipeline_schedule`` (15_beyond_data_parallelism), in ``checks.parallel``
- ``check_lora_linear`` (16_fine_tuning_small_cards), in ``checks.lora``
- ``check_exposed_fraction``, ``check_mystery_answer`` (17_debugging_and_profiling), in ``checks.debugging``
- ``check_largest_micro_batch`` (18_diffusion_on_two_rtx_3060s), in ``checks.diffusion``

The course's solutions live beside their checkers (``solution_*`` and the like), for cells that run them while
``USE_SOLUTION = True``: ``from course_utils.checks import bandwidth as course``.

They raise ``AssertionError`` with an explanation, and return quietly when the code is right.

Import them from here, as the notebooks do (``from course_utils.checks import check_all_reduce``):
the checker you get is wrapped so that a failing check shows the learner's own line and the
verdict, not the checker's insides. The wrapper re-raises the ``AssertionError`` with the
checker's frames cut, from a frame marked ``__tracebackhide__`` (IPython and pytest hide such
frames). Importing from the submodule gives the unwrapped function.
"""
import functools

MODULES = ("accumulation", "all_reduce", "bandwidth", "basics", "buckets", "comm_hook", "debugging", "diffusion",
           "fsdp", "grad_avg", "lora", "micro_ddp", "parallel", "tour", "tradeoffs", "zero")

_WRAPPED = {}  # name -> wrapped checker, so every import returns the same object


def verdict_only(checker):
    """Wrap ``checker`` so a failing check's traceback ends at the caller's line, then the verdict.

    An ``AssertionError`` raised anywhere inside the checker is re-raised here with its traceback
    cleared (so none of ``course_utils/checks/*.py`` is shown) and without its chained context.
    Other exceptions (a bug in the checker, a ``TypeError`` for a misuse) keep their frames.
    """
    @functools.wraps(checker)
    def check(*args, **kwargs):
        __tracebackhide__ = True  # noqa: F841 (read by IPython and pytest)
        try:
            return checker(*args, **kwargs)
        except AssertionError as exc:
            verdict = exc
        verdict.__traceback__ = None
        verdict.__cause__ = None
        verdict.__suppress_context__ = True
        verdict._render_traceback_ = functools.partial(_render_verdict, verdict)   # how IPython shows it
        raise verdict

    check.__wrapped__ = checker
    check._verdict_only = True
    return check


def _shown_frames(tb):
    """The traceback without IPython's own frames, the course package's (a checker's insides) and frames
    marked ``__tracebackhide__``."""
    import types

    kept = []
    while tb is not None:
        frame = tb.tb_frame
        module = frame.f_globals.get("__name__", "") or ""
        hidden = frame.f_locals.get("__tracebackhide__", False)
        if not hidden and not module.startswith(("IPython.", "ipykernel.", "course_utils.")):
            kept.append((frame, tb.tb_lasti, tb.tb_lineno))
        tb = tb.tb_next
    new = None
    for frame, lasti, lineno in reversed(kept):
        new = types.TracebackType(new, frame, lasti, lineno)
    return new


def _render_verdict(verdict):
    """IPython calls this (``_render_traceback_``) to show the error: the caller's lines, then the verdict,
    formatted by IPython itself; IPython's last frame would otherwise be the wrapper's ``raise``."""
    import traceback

    tb = _shown_frames(verdict.__traceback__)
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.InteractiveTB.structured_traceback(type(verdict), verdict, tb, tb_offset=0)
    except Exception:  # no IPython, or a formatter that differs: plain Python formatting below
        pass
    lines = "".join(traceback.format_exception(type(verdict), verdict, tb)).rstrip().splitlines()
    return [line for line in lines if line.strip(" ^~")]  # without Python's column markers under a line


def __getattr__(name):  # import a checker's module only when it is used
    import importlib

    if name in _WRAPPED:
        return _WRAPPED[name]
    if name in MODULES:  # a checker's module itself (its solutions): ``from course_utils.checks import tour``
        return importlib.import_module(f"course_utils.checks.{name}")
    for module in MODULES:
        try:
            mod = importlib.import_module(f"course_utils.checks.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"course_utils.checks.{module}":
                raise
            continue
        if hasattr(mod, name):
            value = getattr(mod, name)
            if name.startswith("check_") and callable(value):
                value = _WRAPPED[name] = verdict_only(value)
            return value
    raise AttributeError(f"course_utils.checks has no checker {name!r}")
