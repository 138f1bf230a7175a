"""Support package of the Micro-DDP course.

``%load_ext course_utils`` registers the ``%%ddp`` cell magic; ``Cluster`` and ``launch``
run code on a pool of torch.distributed ranks from a notebook (00_launcher_tour).
"""
from course_utils.launcher import (
    CellSyntaxError, Cluster, DistributedError, DistributedTimeout, choose_backend, launch)
from course_utils.progress import progress

__all__ = ["Cluster", "CellSyntaxError", "DistributedError", "DistributedTimeout", "choose_backend", "launch",
           "progress"]


def load_ipython_extension(ipython):
    from course_utils.magic import DDPMagics

    ipython.register_magics(DDPMagics)


def unload_ipython_extension(ipython):
    from course_utils.magic import shutdown_cluster

    shutdown_cluster()
