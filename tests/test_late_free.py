"""memory.least_peak: a storage freed late by another thread (gloo's worker) cannot move the measured peak; and lesson
14's DDP and ZeRO-1 rows measure the same bytes every step, which lets the lesson measure them once. Its sharded rows
(least_peak of three steps) are checked against their stored bytes by the lesson itself under nbval, every run.

    .venv/bin/python -m pytest -n 0 tests/test_late_free.py
"""
import sys
import threading

import torch

from course_utils.memory import least_peak, peak_memory

from conftest import register_by_value  # noqa: E402

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module


def late_free_step(late):
    """A step whose 4 MiB temporary is freed by another thread after the step's largest allocation when
    ``late[0]`` is set, before it otherwise: the race of a gloo worker dropping a collective's copy."""
    layer = torch.nn.Linear(64, 64)

    def step():
        layer.zero_grad(set_to_none=True)
        copy = torch.ones(2**20)                       # the collective's copy (4 MiB)
        freed = threading.Event()
        holder = [copy]
        del copy
        if late[0]:
            late[0] = False                             # only the first step is late
            thread = threading.Thread(target=lambda: (freed.wait(), holder.clear()))
            thread.start()
        else:
            holder.clear()
            thread = None
        big = torch.ones(2**21)                         # 8 MiB: the step's peak allocation
        del big
        if thread is not None:
            freed.set()
            thread.join()
        layer(torch.ones(1, 64)).sum().backward()

    return step, layer


def test_a_late_free_raises_one_measurement_and_not_the_least():
    step, layer = late_free_step([True])
    late = peak_memory(step, layer)["total"]
    on_time = peak_memory(step, layer)["total"]
    assert late - on_time == 4 * 2**20, (
        f"the late copy should add exactly its 4 MiB to one step's peak: late {late}, on time {on_time}")
    step, layer = late_free_step([True])
    least = least_peak(step, layer, repeats=3)["total"]
    assert least == on_time, f"least_peak should ignore the late step: {least} against {on_time}"


def lesson14_replica_peaks(steps=4):
    """Lesson 14's DDP and ZeRO-1 rows (the same model, batch and steps as its section 1): ``peak_memory`` of
    ``steps`` steps in a row, this rank's totals in bytes. Their only collective is DDP's all-reduce, in place on a
    bucket the reducer keeps, so no storage that the meter tracks is left to gloo's thread to free."""
    import warnings

    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.gpt import CharTokenizer, load_corpus, make_gpt
    from course_utils.zero import ShardedOptimizer

    warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    tokenizer = CharTokenizer(load_corpus())
    batch = torch.randint(tokenizer.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    mine = batch[rank * 2:(rank + 1) * 2]
    totals = {}
    for name in ("DDP, 2 ranks", "ZeRO-1, 2 ranks"):
        model = DDP(make_gpt(tokenizer.vocab_size, seed=0, n_layer=48, n_embd=64))
        optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-3) if name.startswith("DDP")
                     else ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3))

        def step():
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(mine).flatten(0, 1), mine.flatten()).backward()
            optimizer.step()

        step()
        step()                                         # DDP rebuilds its buckets in its second step
        totals[name] = [peak_memory(step, model, optimizer)["total"] for _ in range(steps)]
    return totals


def test_lesson14_replica_rows_measure_the_same_bytes_every_step(make_cluster):
    """What lets lesson 14 measure its DDP and ZeRO-1 rows once, and only the rows with a late margin thrice."""
    cluster = make_cluster(2, timeout=600)
    for rank, totals in enumerate(cluster.run(lesson14_replica_peaks)):
        for name, measured in totals.items():
            assert len(set(measured)) == 1, f"rank {rank}, {name}: one step's peak varied: {measured}"
            assert measured[0] > 0, f"rank {rank}, {name}: nothing measured"
