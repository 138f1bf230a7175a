"""The %%ddp engine: a persistent pool of torch.distributed ranks driven from a notebook.

``launcher`` (``Cluster``, ``launch``, ``spawn``), ``_worker`` (one rank), ``_wire`` (framing on the
pipes), ``magic`` (``%%ddp``), ``progress``, ``env`` (``check_environment``), ``export`` (``%ddp export``).
The public names are re-exported by ``course_utils``.
"""
