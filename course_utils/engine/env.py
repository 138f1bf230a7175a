"""What this machine offers the engine (its GPUs, its cores, the backend a cluster gets) and the environment check
at the top of 00_launcher_tour: what the course needs, and what it found.

The [OK]/[FAIL] lines name requirements only, so they read the same on every machine that meets them;
what differs between machines (versions, GPUs, the backend %%ddp picks) is on lines that start with
"This machine:" (sanitised by tests/sanitize.cfg)."""
import importlib
import os
import platform
import subprocess
import sys

BACKENDS = ("auto", "gloo", "nccl")

REQUIRED = [  # (import name, why the course needs it)
    ("torch", "tensors, autograd and torch.distributed"),
    ("cloudpickle", "sends notebook functions to the ranks"),
    ("threadpoolctl", "sizes each rank's BLAS thread pools"),
    ("matplotlib", "plots"),
    ("ipywidgets", "the interactive cost model in lesson 10"),
    ("nbval", "runs the notebooks as tests"),
]


def _gpu_count():
    """Visible CUDA devices, without initialising CUDA in this process."""
    torch = sys.modules.get("torch")
    if torch is None:
        import torch
    if not torch.version.cuda:
        return 0
    n = torch.cuda._device_count_nvml()
    if n >= 0:
        return n
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                         capture_output=True, text=True)
    return int(out.stdout.strip() or 0)


def choose_backend(backend="auto", world_size=2):
    """'nccl' when every rank can have its own GPU, else 'gloo'. Raises ValueError on bad input."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}. "
                         "Use world_size=2 for a first try.")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}. "
                         "'auto' picks nccl when there is a GPU per rank, else gloo.")
    if backend == "gloo":
        return "gloo"
    gpus = _gpu_count()
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{gpus} GPU(s) are visible. Use backend='gloo' (CPU) or a smaller world_size.")
    return "nccl" if gpus >= world_size else "gloo"


def _cpu_count():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _is_torch_2_13(version):
    """True for 2.13 in any patch release and build ("2.13.0", "2.13.1+cpu"), not for "2.1.3" or "2.130"."""
    return version.split("+")[0].split(".")[:2] == ["2", "13"]


def check_environment(world_sizes=(1, 2, 4)):
    """Print [OK]/[FAIL] per requirement, the devices, and the backend %%ddp would choose.

    Introduced in 00_launcher_tour. Returns True when everything the course needs is there."""
    ok = True

    def report(good, text):
        nonlocal ok
        ok &= bool(good)
        print(f"[{'OK' if good else 'FAIL'}] {text}")

    found = [f"Python {platform.python_version()}"]
    report(sys.version_info >= (3, 10), "Python 3.10 or newer")
    for name, why in REQUIRED:
        try:
            module = importlib.import_module(name)
            found.append(f"{name} {getattr(module, '__version__', '?')}")
            report(True, f"{name}: {why}")
        except ImportError as exc:
            report(False, f"{name} is missing ({exc}): run `make lab` to set up the environment")
    import torch
    import torch.distributed as dist

    report(_is_torch_2_13(str(torch.__version__)), "torch 2.13 (the version the course is tested with)")
    report(dist.is_available(), "torch.distributed is available")
    report(dist.is_gloo_available(), "the gloo backend (CPU) is available")
    gpus = _gpu_count()
    print(f"This machine: {', '.join(found)}")
    print(f"This machine: devices cpu{''.join(f', cuda:{i}' for i in range(gpus))} "
          f"({gpus} GPU{'s' if gpus != 1 else ''} visible), NCCL available: {dist.is_nccl_available()}")
    print("This machine: " + "; ".join(f"%%ddp -n {n} would use {choose_backend('auto', n)}" for n in world_sizes))
    return ok
