"""The %%ddp engine: a persistent pool of torch.distributed ranks driven from a notebook.

``launcher`` (``Cluster``), ``oneshot`` (``launch``, ``spawn``), ``ranks`` (the ranks' processes and pipes),
``_forkstart`` (the fork servers), ``_worker`` (one rank), ``_wire`` (framing on the pipes), ``reports`` (the error
reports), ``magic`` (``%%ddp``), ``progress``, ``env`` (the machine, ``check_environment``), ``export``
(``%ddp export``).
The public names are re-exported by ``course_utils``. What the engine promises (options, failures, start-up,
safety) is specified once, in docs/engine.md; the modules' docstrings say how, not again what.
"""
