"""Support package of the Micro-DDP course.

``%load_ext course_utils`` registers the ``%%ddp`` cell magic; ``Cluster`` and ``launch``
run code on a pool of torch.distributed ranks from a notebook, and ``spawn`` is the drop-in for
``torch.multiprocessing.spawn`` (00_launcher_tour). The engine
lives in ``course_utils.engine``; the lesson helpers are the other modules of this package.

The package by lesson (each module's docstring says "Introduced in NN_..."):

- ``engine`` (00 onwards): ``%%ddp``, ``Cluster``, ``launch``, ``spawn``, ``%ddp export`` (11); its one
  specification is docs/engine.md, its modules are listed in ``engine/__init__.py``
- ``checks`` (every lesson with an exercise): the self-checks and the course's solutions, one module per lesson or
  two, behind one verdict wrapper; ``checks/__init__.py`` lists them by lesson
- ``describe`` (01, 03, 04, 07, 09, 13, 17): the sentences a lesson prints after "Measured here:", each chosen from
  that run's numbers, one section per lesson
- ``data``, ``models``, ``plots``, ``memory`` (01 onwards): generated data, the small models every lesson
  trains, the shared pictures, and memory measured from the tensors (peaks over a step, DDP's bucket)
- ``allreduce`` (03): all-reduce by hand from send/recv, and the byte counter
- ``bench`` (03, 04): bandwidth measured as nccl-tests does, and the alpha-beta fit per call of a whole
  operation (``fit_call_alpha_beta``)
- ``ddp_probes`` (06, 07): recording and drawing what DDP does (its all-reduces, its buckets, a timeline)
- ``hooks`` (08, 09): DDP communication hooks and a byte counter for any hook
- ``costmodel`` (10): the step-time model (alpha-beta per ring hop, ``fit_hop_alpha_beta``, plus compute) and
  its sliders
- ``micro_ddp``, ``gpt`` (11): the course's own DDP, and the tiny GPT it trains (with ``corpus.txt``)
- ``zero`` (12): ZeRO-1/2 by hand (``ShardedOptimizer``) and the collectives counter
- ``fsdp`` (13): MicroFSDP, ZeRO-3 by hand
- ``true_size`` (14, 16): training memory of a real-size model measured with fake tensors
- ``tensor_parallel``, ``pipeline`` (15): Megatron-style tensor parallelism and GPipe/1F1B pipelines by hand
- ``lora`` (16): LoRA by hand on ``transformers``' Llama, adapters in ``peft``'s format
- ``will_it_fit``, ``model_zoo`` (16, 18; the README's "Will it fit?"): a reader's model and cards, measured
- ``planted_bugs``, ``debugging`` (17): a torchrun job with a bug planted on purpose, and reading what a
  cluster's tools leave behind (Flight Recorder dumps, py-spy stacks, profiler traces)
- ``diffusion`` (18): a tiny diffusion UNet trained data-parallel, and Stable Diffusion at true size
"""
from course_utils.engine.launcher import CellSyntaxError, Cluster, DistributedError, DistributedTimeout, choose_backend
from course_utils.engine.oneshot import launch, spawn
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
