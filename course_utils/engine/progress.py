"""Progress for long loops, live while they run and invisible in the stored notebook.

Introduced in 00_launcher_tour. On a rank, ``progress`` reports to the ``%%ddp`` cell's live
status line; in the notebook process it shows a status line whose final text equals its
first, so the output that nbval compares does not depend on timing.
"""
import time

THROTTLE_S = 0.2


def progress(iterable, total=None, desc="progress"):
    """Iterate over ``iterable`` and report how far along it is: ``for step in progress(range(200), desc="train")``."""
    if total is None:
        total = len(iterable)
    from course_utils.engine import _worker  # the same module object as the worker's __main__ on a rank

    channel = _worker._CHANNEL
    show = _notebook_line(desc, total) if channel is None else None
    last = 0.0
    for i, item in enumerate(iterable):
        now = time.monotonic()
        if now - last > THROTTLE_S:
            last = now
            if channel is not None:
                channel.send(("progress", desc, i, total))  # the notebook knows the rank by its pipe
            elif show is not None:
                show(i, total)
        yield item
    if show is not None:
        show(None, total)


def bar(desc, i, total, width=24):
    filled = int(width * i / max(total, 1))
    return f"{desc} [{'#' * filled}{'.' * (width - filled)}] {i}/{total}"


def _notebook_line(desc, total):
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        return None
    if get_ipython() is None or not hasattr(get_ipython(), "kernel"):
        return None
    final = {"text/plain": f"{desc}: {total} step{'' if total == 1 else 's'}"}
    handle = display(final, raw=True, display_id=True)

    def show(i, total):
        handle.update(final if i is None else {"text/plain": bar(desc, i, total)}, raw=True)

    return show
