"""Turn a notebook's ``%%ddp`` cells into a script that torchrun runs: ``%ddp export PATH``.

Introduced in 11_capstone_micro_ddp. The script starts like a ``%%ddp`` rank (the process group from torchrun's
environment; ``rank``, ``world_size``, ``local_rank``, ``device``), then runs the cells and ``%ddp push`` values
since the ranks were last started, in the order they ran, each cell's last value shown as ``[rank N] value``; a
cell's own init/destroy_process_group behave as on a rank. At the end the cells' names are deleted before the
group is destroyed (a DDP model left in a global keeps gloo alive into finalisation). All but the imports and the
cells' definitions runs under ``if __name__ == "__main__":``, so a spawn child of a cell starts no second group.
"""
import ast
import base64
import io
import re
import tokenize
from pathlib import Path

PREAMBLE = '''\
"""Exported from a notebook's %%ddp cells by course_utils.engine.export.write_script.

    torchrun --standalone --nproc-per-node={world_size} {name}
{note}"""
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group (see scripts/train_micro_ddp.py's setup())

# What the %%ddp engine sets up on every rank: the process group and four names.
rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
# torchrun sets LOCAL_RANK and LOCAL_WORLD_SIZE; srun alone sets SLURM_LOCALID and SLURM_(N)TASKS_PER_NODE
local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", -1)))
_local = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or \
    os.environ.get("SLURM_TASKS_PER_NODE")
if local_rank < 0 or not _local:
    raise SystemExit("set LOCAL_RANK and LOCAL_WORLD_SIZE (processes on this node); torchrun sets them for you")
local_world_size = int(_local.split("(")[0].split(",")[0])
BACKEND = {backend!r}  # what the cells ran with in the notebook; "auto": NCCL when every process has a GPU
if BACKEND == "nccl" or (BACKEND == "auto" and torch.cuda.is_available()
                         and torch.cuda.device_count() >= local_world_size):
    device = torch.device("cuda", local_rank)  # one GPU per process on this node (the engine's cuda:rank on one node)
else:
    device = torch.device("cpu")
_BACKEND = "nccl" if device.type == "cuda" else "gloo"
_torch_init, _torch_destroy = dist.init_process_group, dist.destroy_process_group
# A multiprocessing child in the spawn or forkserver context imports this file again (as __mp_main__): there only
# the imports and the cells' definitions run, never the group's start or the cells' statements.
if __name__ == "__main__":
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_BACKEND)


def _init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, *args, **kwargs):
    """A cell's own init_process_group (code written for torchrun), as on a %%ddp rank: the group is set up."""
    if not dist.is_initialized():  # after a destroy of the script's own: the cell's call is honoured
        return _torch_init(backend, init_method, timeout, world_size, rank, *args, **kwargs)
    wrong = []
    if world_size not in (-1, None) and int(world_size) != dist.get_world_size():
        wrong.append(f"world_size={{world_size}}, but torchrun started {{dist.get_world_size()}} processes")
    if rank not in (-1, None) and int(rank) != dist.get_rank():
        wrong.append(f"rank={{rank}}, but this is rank {{dist.get_rank()}}")
    if backend and str(backend).lower() != _BACKEND and ":" not in str(backend):
        wrong.append(f"backend={{backend!r}}, but this script runs {{_BACKEND!r}}")
    if wrong:
        raise ValueError("init_process_group: " + "; ".join(wrong) + ". Start matching processes with "
                         "torchrun --nproc-per-node=N.")
    print("note: init_process_group(): the process group is already initialised (rank "
          f"{{dist.get_rank()}} of {{dist.get_world_size()}}, {{_BACKEND}}); this call does nothing.",
          file=sys.stderr, flush=True)


def _destroy_process_group(group=None):
    """A cell's destroy_process_group() keeps the group for the cells after it, as on a %%ddp rank."""
    if group is not None and group is not dist.GroupMember.WORLD:
        return _torch_destroy(group)
    print("note: destroy_process_group(): kept the process group for the next cell.", file=sys.stderr, flush=True)


import torch.distributed.distributed_c10d as _c10d  # noqa: E402

for _module in (dist, _c10d):
    _module.init_process_group, _module.destroy_process_group = _init_process_group, _destroy_process_group


def _show(value):
    """A cell's last value, shown as the notebook showed it: every line prefixed with the rank."""
    if value is not None:
        print("\\n".join(f"[rank {{rank}}] {{line}}" for line in repr(value).splitlines() or [""]))


class _only_rank:
    """%%ddp --rank R: the other ranks' printed output is hidden, as in the notebook. Their stderr stays:
    an error on any rank must show."""

    def __init__(self, shown):
        self.shown = shown

    def __enter__(self):
        self.saved = sys.stdout
        if rank != self.shown:
            sys.stdout = open(os.devnull, "w")

    def __exit__(self, *exc):
        if sys.stdout is not self.saved:
            sys.stdout.close()
        sys.stdout = self.saved


_SCRIPT_NAMES = set(globals()) | {{"_SCRIPT_NAMES"}}  # the cells' names are the others (see the end)
'''

EPILOGUE = '''

# The end: every rank is done with the group before any rank destroys it. The cells' names go first: a DDP
# model (its Reducer) or an optimizer left in a global kept the group and gloo's threads alive into the
# interpreter's shutdown, which then aborted ("terminate called without an active exception").
if __name__ == "__main__":
    dist.barrier()
    for _name in [_name for _name in globals() if _name not in _SCRIPT_NAMES]:
        del globals()[_name]
    import gc

    gc.collect()
    _torch_destroy()
'''
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom)


def _show_last_value(source):
    """A cell shows its last expression's value; the script shows it with ``_show``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source  # left as is: Python reports it when the script runs
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return source
    last = tree.body[-1]
    lines = source.splitlines()
    value = ast.get_source_segment(source, last.value)
    # col_offset counts UTF-8 bytes, not characters ('héllo' is 6 bytes)
    before = lines[last.lineno - 1].encode("utf-8")[:last.col_offset].decode("utf-8")  # e.g. "x = 1; "
    return "\n".join(lines[:last.lineno - 1] + [f"{before}_show({value})"] + lines[last.end_lineno:])


def _rank_option(options):
    m = re.search(r"--rank[ =](\d+)", options or "")
    return int(m.group(1)) if m else None


def _indent(code):
    """``code`` indented one level, except the lines inside a multi-line string (their text stays as it was)."""
    inside = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                inside.update(range(tok.start[0] + 1, tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        pass
    return "".join(line if i in inside or not line.strip() else "    " + line
                   for i, line in enumerate(code.splitlines(keepends=True), 1))


def _pieces(source):
    """The cell as [(is a definition, code)] in order: imports, functions and classes (which a spawn child of the
    script needs) apart from the statements. One piece, a statement, when the cell does not parse or shares a line
    between two statements."""
    try:
        nodes = ast.parse(source).body
    except SyntaxError:
        return [(False, source)]
    lines = source.splitlines(keepends=True)
    pieces, start = [], 0
    for i, node in enumerate(nodes):
        end = len(lines) if i == len(nodes) - 1 else node.end_lineno
        if i + 1 < len(nodes) and nodes[i + 1].lineno <= node.end_lineno:
            return [(False, source)]
        kind = isinstance(node, DEFINITIONS)
        code = "".join(lines[start:end])
        if pieces and pieces[-1][0] == kind:
            pieces[-1] = (kind, pieces[-1][1] + code)
        else:
            pieces.append((kind, code))
        start = end
    return pieces or [(False, source)]


def cell_to_code(options, source):
    """One ``%%ddp`` cell as script code, under a comment with its options: its definitions at the top level, its
    statements under ``if __name__ == "__main__":`` (inside ``with _only_rank(R):`` for ``--rank R``)."""
    shown = _rank_option(options)
    parts = []
    for definition, code in _pieces(_show_last_value(source)):
        code = code.rstrip() + "\n"
        if not definition:
            if shown is not None:
                code = f"with _only_rank({shown}):\n" + _indent(code)
            code = 'if __name__ == "__main__":\n' + _indent(code)
        parts.append(code)
    return f"\n# %%ddp {options}".rstrip() + "\n" + "".join(parts)


def push_to_code(name, blob):
    """``%ddp push NAME``: the value travels in the script, pickled as the engine sent it."""
    data = base64.b64encode(blob).decode("ascii")
    return (f"\n# %ddp push {name}\nimport base64, pickle  # noqa: E401\n"
            f"{name} = pickle.loads(base64.b64decode({data!r}))[{name!r}]\n")


def write_script(path, cells, world_size=2, left_out=0, backend="auto"):
    """Write ``cells`` as a torchrun-ready script at ``path``; return the path.

    ``cells`` lists, in the order they ran, ``("cell", options line, source)`` for each ``%%ddp`` cell
    and ``("push", name, pickled {name: value})`` for each ``%ddp push`` (a plain ``(options, source)``
    pair is a cell). ``world_size`` goes into the launch hint; ``left_out`` cells from before the
    ranks were last started are mentioned in the docstring."""
    path = Path(path)
    note = ""
    if left_out:
        note = (f"\n{left_out} earlier %%ddp cell(s) ran on ranks that were replaced since (a restart, a crash or\n"
                "another world size) and are left out: their names were gone for the cells below too.\n")
    parts = [PREAMBLE.format(name=path.name, world_size=world_size, note=note, backend=backend)]
    for item in cells:
        if len(item) == 2:
            item = ("cell", *item)
        kind, a, b = item
        parts.append(cell_to_code(a, b) if kind == "cell" else push_to_code(a, b))
    parts.append(EPILOGUE)
    path.write_text("".join(parts), encoding="utf-8")
    return path
