"""Support package of the Micro-DDP course.

``%load_ext course_utils`` registers the ``%%ddp`` cell magic; ``Cluster`` and ``launch``
run code on a pool of torch.distributed ranks from a notebook, and ``spawn`` is the drop-in for
``torch.multiprocessing.spawn`` (00_launcher_tour). The engine
lives in ``course_utils.engine``; the lesson helpers are the other modules of this package.
"""
from course_utils.engine.launcher import (
    CellSyntaxError, Cluster, DistributedError, DistributedTimeout, choose_backend, launch, spawn)
from course_utils.engine.progress import progress

__all__ = ["Cluster", "CellSyntaxError", "DistributedError", "DistributedTimeout", "choose_backend", "get_cluster",
           "launch", "progress", "spawn"]


def __getattr__(name):
    if name == "get_cluster":  # lazily: the ranks import this package too, and must not pay for IPython
        from course_utils.engine.magic import get_cluster

        return get_cluster
    raise AttributeError(f"module 'course_utils' has no attribute {name!r}")


def load_ipython_extension(ipython):
    from course_utils.engine import _forkstart
    from course_utils.engine.magic import DDPMagics

    ipython.register_magics(DDPMagics)
    _forkstart.prestart()  # the fork server imports torch while the learner reads the first cells


def unload_ipython_extension(ipython):
    from course_utils.engine.magic import unload

    unload()  # the clusters and the fork server: %load_ext course_utils starts a new server
