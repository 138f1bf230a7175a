"""Length-prefixed cloudpickle frames over the private pipes between the notebook and its workers.

Pipes, not sockets: only the two processes that share a pipe can write to it, so
unpickling what arrives on one is as safe as unpickling your own data.
"""
import io
import os
import struct
import sys
import types
from collections import ChainMap

import cloudpickle
from cloudpickle import cloudpickle as _cp

# cloudpickle's reduction of code objects is private API: without it, frames keep their
# "<dynamic-code>"-style names (tracebacks lose the notebook's "Cell In[N]"), nothing else changes.
_CODE_REDUCE = getattr(_cp, "_code_reduce", None)

HEADER = struct.Struct("!Q")


class _Missing:
    """What a rank answers to pull() for a name it does not have (pickled by reference)."""

    def __repr__(self):
        return "<missing>"


MISSING = _Missing()


def _named_code(args, filename):
    return types.CodeType(*args).replace(co_filename=filename)


class Pickler(cloudpickle.Pickler):
    """cloudpickle renames every code object "<dynamic-code>"; this one keeps the real name (or
    the notebook's "Cell In[N]" for it), so a rank's traceback can show the cell's lines."""

    def __init__(self, file, rename=None):
        self.rename = rename or {}
        if _CODE_REDUCE is not None:  # the C pickler reads dispatch_table once, in __init__
            self.dispatch_table = ChainMap({types.CodeType: self._code_reduce}, cloudpickle.Pickler.dispatch_table)
        super().__init__(file)

    def _code_reduce(self, code):
        name = self.rename.get(code.co_filename, code.co_filename)
        return _named_code, (_CODE_REDUCE(code)[1], name)



class _CPUPickler(Pickler):
    """Used once this process has initialised CUDA (a rank on NCCL): a tensor on a GPU travels as a CPU
    tensor, since unpickling it would initialise CUDA in the notebook."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            if isinstance(obj, torch.nn.Parameter):  # stays a Parameter, as pickle keeps it on the CPU
                return torch.nn.Parameter, (obj.detach().to("cpu"), obj.requires_grad)
            return _same, (obj.detach().to("cpu"),)
        return super().reducer_override(obj)


def _cuda_in_use():
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _same(value):
    return value


class Undecodable:
    """A frame that arrived whole but could not be unpickled (the reader stays usable)."""

    def __init__(self, error):
        self.error = error


def dumps(obj, rename=None) -> bytes:
    buf = io.BytesIO()
    (_CPUPickler if _cuda_in_use() else Pickler)(buf, rename).dump(obj)
    return buf.getvalue()


def dump(obj) -> bytes:
    data = dumps(obj)
    return HEADER.pack(len(data)) + data


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def read_exact(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv(fd: int):
    (n,) = HEADER.unpack(read_exact(fd, HEADER.size))
    return cloudpickle.loads(read_exact(fd, n))


class FrameReader:
    """Incremental decoder for a non-blocking pipe: feed bytes, get whole messages."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes):
        self.buf += data
        out = []
        while len(self.buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self.buf)
            if len(self.buf) < HEADER.size + n:
                break
            frame = bytes(self.buf[HEADER.size:HEADER.size + n])
            del self.buf[:HEADER.size + n]  # first: a frame that fails to load must not jam the ones after it
            try:
                out.append(cloudpickle.loads(frame))
            except Exception as exc:
                out.append(Undecodable(exc))
        return out
