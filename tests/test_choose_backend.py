"""``choose_backend``: which backend ``%%ddp -n N`` and ``Cluster(backend="auto")`` pick, with a faked GPU count.

    .venv/bin/python -m pytest tests/test_choose_backend.py -q

The rule (docs/gpus.md): NCCL when every rank can have its own GPU (N <= visible GPUs), else
gloo on the CPU; ``--backend nccl`` with too few GPUs is an error that says so; ``--backend gloo`` is always
gloo. The notebook process counts GPUs without initialising CUDA (NVML), so the fake replaces every way torch
can report a count: ``torch.version.cuda`` (a CUDA build), ``torch.cuda._device_count_nvml``,
``torch.cuda.device_count`` and ``torch.cuda.is_available``. Nothing here starts a rank or touches a GPU.
"""
import types

import pytest
import torch

from course_utils import choose_backend
from course_utils.engine import launcher


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)`` makes this process see ``n`` CUDA devices (``n=None``: a CPU-only build of torch)."""

    def fake(n, nvml=True):
        monkeypatch.setattr(torch.version, "cuda", None if n is None else "12.8")
        count = n or 0
        monkeypatch.setattr(torch.cuda, "_device_count_nvml", (lambda: count) if nvml else (lambda: -1))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)

        def no_subprocess(cmd, **kwargs):  # NVML unavailable: the engine asks a fresh interpreter instead
            return types.SimpleNamespace(stdout=f"{count}\n", stderr="", returncode=0)
        monkeypatch.setattr(launcher.subprocess, "run", no_subprocess)
    return fake


@pytest.mark.parametrize("n_gpus", [None, 0])
def test_without_gpus_auto_is_gloo_and_nccl_is_refused(gpus, n_gpus):
    gpus(n_gpus)
    assert [choose_backend("auto", n) for n in (1, 2, 8)] == ["gloo"] * 3
    assert choose_backend("gloo", 4) == "gloo"
    with pytest.raises(ValueError, match=r"needs one GPU per rank: world_size=1 but 0 GPU\(s\) are visible"):
        choose_backend("nccl", 1)


@pytest.mark.parametrize("nvml", [True, False], ids=["nvml", "fresh-interpreter"])
def test_two_gpus_give_nccl_up_to_two_ranks_and_gloo_beyond(gpus, nvml):
    gpus(2, nvml=nvml)  # Kaggle's 2 x T4
    assert launcher._gpu_count() == 2
    assert choose_backend("auto", 1) == "nccl"
    assert choose_backend("auto", 2) == "nccl"
    assert choose_backend("auto", 3) == "gloo", "3 ranks on 2 GPUs: NCCL cannot put two ranks on one GPU"
    assert choose_backend("auto", 4) == "gloo"
    assert choose_backend("nccl", 2) == "nccl"
    assert choose_backend("gloo", 2) == "gloo", "--backend gloo is gloo even with GPUs"
    with pytest.raises(ValueError, match=r"world_size=4 but 2 GPU\(s\) are visible.*backend='gloo'"):
        choose_backend("nccl", 4)


def test_one_gpu_gives_nccl_only_to_a_world_of_one(gpus):
    gpus(1)
    assert choose_backend("auto", 1) == "nccl"
    assert choose_backend("auto", 2) == "gloo"
    with pytest.raises(ValueError):
        choose_backend("nccl", 2)


def test_eight_gpus_give_nccl_to_every_lesson_size(gpus):
    gpus(8)
    assert {choose_backend("auto", n) for n in (1, 2, 3, 4, 8)} == {"nccl"}
    assert choose_backend("auto", 9) == "gloo"


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0, "2", None])
def test_a_bad_world_size_is_refused_before_counting_gpus(gpus, world_size):
    gpus(2)
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        choose_backend("auto", world_size)


@pytest.mark.parametrize("backend", ["mpi", "NCCL", "", None])
def test_an_unknown_backend_is_refused_with_the_choices(gpus, backend):
    gpus(2)
    with pytest.raises(ValueError, match="unknown backend .*auto.*gloo.*nccl"):
        choose_backend(backend, 2)


def test_the_environment_check_reports_what_ddp_would_pick(gpus, capsys):
    from course_utils.engine.env import check_environment

    gpus(2)
    check_environment(world_sizes=(1, 2, 4))
    out = capsys.readouterr().out
    assert "2 GPUs visible" in out and "cuda:0, cuda:1" in out, out
    assert "%%ddp -n 1 would use nccl; %%ddp -n 2 would use nccl; %%ddp -n 4 would use gloo" in out, out
    gpus(None)
    check_environment(world_sizes=(2,))
    assert "%%ddp -n 2 would use gloo" in capsys.readouterr().out


@pytest.mark.parametrize("version, verdict", [("2.13.0", "OK"), ("2.13.1+cpu", "OK"), ("2.12.1", "FAIL"),
                                              ("2.14.0+cu128", "FAIL"), ("2.1.3", "FAIL"), ("2.130.0", "FAIL")])
def test_the_environment_check_fails_on_another_torch_than_2_13(gpus, capsys, monkeypatch, version, verdict):
    from course_utils.engine.env import check_environment

    gpus(None)
    monkeypatch.setattr(torch, "__version__", version)
    ok = check_environment(world_sizes=(2,))
    out = capsys.readouterr().out
    assert f"[{verdict}] torch 2.13 (the version the course is tested with)" in out, out
    if verdict == "FAIL":
        assert ok is False, f"torch {version}: check_environment() returned {ok}, though it printed [FAIL]"
    assert f"torch {version}" in out, "the 'This machine:' line names the version found"
