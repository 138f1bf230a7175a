"""Checkers that explain in plain words what is wrong. Each lives in its own module:

- ``check_all_reduce`` (03_all_reduce_by_hand), in ``checks.all_reduce``
- ``check_grad_averaging`` (05_manual_gradient_averaging), in ``checks.grad_avg``
- ``check_comm_hook`` (08_comm_hooks), in ``checks.comm_hook``
- ``check_broadcast_state``, ``check_assign_buckets``, ``check_start_allreduce``, ``check_micro_ddp``,
  ``check_compressor`` (11_capstone_micro_ddp), in ``checks.micro_ddp``

They raise ``AssertionError`` with an explanation, and return quietly when the code is right.
"""


def __getattr__(name):  # import a checker's module only when it is used
    import importlib

    for module in ("all_reduce", "comm_hook", "grad_avg", "micro_ddp"):
        try:
            mod = importlib.import_module(f"course_utils.checks.{module}")
        except ModuleNotFoundError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
    raise AttributeError(f"course_utils.checks has no checker {name!r}")
