"""What the peak meter sees of gloo's own copies (lesson 14 adds only what it does not see): gloo's reduce-scatter
copies its input through a tensor made on the calling thread, which ``peak_memory`` counts; its all-gather copies
through memory of its own, which no tensor meter counts.

    .venv/bin/python -m pytest -n 0 tests/test_gloo_copies.py
"""
import sys

from conftest import register_by_value  # noqa: E402

register_by_value(sys.modules[__name__])  # the ranks cannot import this test module

NUMEL = 2**18          # 1 MiB of fp32: the copies are whole multiples of it


def peaks_of_gloo_collectives():
    """This rank's peak over one reduce-scatter and one all-gather, beyond the tensors the step itself made."""
    import torch
    import torch.distributed as dist

    from course_utils.memory import peak_memory

    world_size = dist.get_world_size()
    result = {}

    def reduce_scatter():
        full, shard = torch.ones(NUMEL), torch.empty(NUMEL // world_size)
        dist.reduce_scatter_single(shard, full)

    def all_gather():
        full, shard = torch.empty(NUMEL), torch.ones(NUMEL // world_size)
        dist.all_gather_single(full, shard)

    for name, step in (("reduce-scatter", reduce_scatter), ("all-gather", all_gather)):
        made = 4 * (NUMEL + NUMEL // world_size)            # the full tensor and the shard
        result[name] = (peak_memory(step)["total"] - made) / (4 * NUMEL)
    return result


def test_the_meter_sees_gloo_s_reduce_scatter_copy_and_not_its_all_gather_copy(make_cluster):
    for rank, extra in enumerate(make_cluster(2).run(peaks_of_gloo_collectives)):
        assert extra["reduce-scatter"] == 1, (
            f"rank {rank}: the meter should count gloo's reduce-scatter copy (1 full tensor more), saw {extra}")
        assert extra["all-gather"] == 0, (
            f"rank {rank}: gloo's all-gather copy is its own memory, unseen by the meter; saw {extra}")
