"""Turn a notebook's ``%%ddp`` cells into a script that torchrun runs: ``%ddp export PATH``.

Introduced in 11_capstone_micro_ddp. The script starts like a ``%%ddp`` rank: it initialises the
process group from torchrun's environment and defines ``rank``, ``world_size``, ``local_rank``
and ``device``; then come the cells, in the order they ran; then ``destroy_process_group``.
"""
import ast
import re
from pathlib import Path

PREAMBLE = '''\
"""Exported from a notebook's %%ddp cells by course_utils.engine.export.write_script.

    torchrun --standalone --nproc-per-node=2 {name}
{sizes}"""
import os

import torch
import torch.distributed as dist

# What the %%ddp engine sets up on every rank: the process group and four names.
rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", world_size)):
    device = torch.device("cuda", local_rank)  # one GPU per process on this node (the engine's cuda:rank on one node)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
'''

EPILOGUE = '''
dist.destroy_process_group()
'''

_MAGIC = re.compile(r"^(\s*)([%!].*)$")


def _comment_magics(source):
    """IPython-only lines (``%magic``, ``!shell``) become comments (``%time stmt`` keeps ``stmt``);
    inside a block, ``pass`` keeps the block valid."""
    try:
        ast.parse(source)
        return source  # plain Python: a line starting with % is a continued expression, not a magic
    except SyntaxError:
        pass
    out = []
    for line in source.splitlines():
        m = _MAGIC.match(line)
        if m:
            indent, rest = m.groups()
            timed = re.match(r"%time\s+(\S.*)", rest)
            if timed:  # %time runs its statement once: keep the statement
                out.append(f"{indent}{timed.group(1)}  # {rest}")
            else:
                out.append(f"{indent}pass  # {rest}" if indent else f"# {rest}")
        else:
            out.append(line)
    return "\n".join(out)


def _show_last_value(source):
    """A cell shows its last expression's value; the script prints it, as ``[rank N] value`` lines do."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source  # left as is: Python reports it when the script runs
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return source
    call = tree.body[-1].value
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print":
        return source  # prints already, and its value is None
    last = tree.body[-1]
    lines = source.splitlines()
    value = ast.get_source_segment(source, last.value)
    before = lines[last.lineno - 1][:last.col_offset]  # e.g. "x = 1; " before the expression
    return "\n".join(lines[:last.lineno - 1] + [
        f"{before}_value = ({value})",
        "if _value is not None:",
        '    print(f"[rank {rank}] {_value!r}")',
    ] + lines[last.end_lineno:])


def cell_to_code(options, source):
    """One ``%%ddp`` cell as script code, under a comment with its options."""
    body = _show_last_value(_comment_magics(source))
    return f"\n# %%ddp {options}".rstrip() + "\n" + body.rstrip() + "\n"


def write_script(path, cells):
    """Write ``cells`` -- (options line, cell source) of each ``%%ddp`` cell run, in order -- as a
    torchrun-ready script at ``path``. Returns the path."""
    path = Path(path)
    sizes = sorted({_world_size(opts) for opts, _ in cells} - {None})
    note = ""
    if sizes:
        note = (f"\nThe notebook ran these cells on {' and '.join(map(str, sizes))} ranks; under torchrun all of "
                "them run on --nproc-per-node x --nnodes ranks.\n")
    parts = [PREAMBLE.format(name=path.name, sizes=note)]
    parts += [cell_to_code(opts, src) for opts, src in cells]
    parts.append(EPILOGUE)
    path.write_text("".join(parts), encoding="utf-8")
    return path


def _world_size(options):
    m = re.search(r"(?:-n|--world-size)[ =]?(\d+)", options or "")
    return int(m.group(1)) if m else None
