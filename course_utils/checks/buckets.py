"""Self-checks of 07_buckets_and_overlap's exercises, and the course's answers to them.

- ``check_rebuilt_buckets``: exercise 1, how many buckets DDP rebuilds with ``bucket_cap_mb=0.25``
  (``solution_rebuilt_buckets`` is the course's answer);
- ``check_bucket0_prediction``: exercise 2, which parameters land in bucket 0 of the rebuilt layout
  (``REORDERED_BUCKET0`` is the course's answer).

Neither verdict gives the number or the names away.
"""

__all__ = ["check_rebuilt_buckets", "check_bucket0_prediction", "solution_rebuilt_buckets", "REORDERED_BUCKET0"]


def solution_rebuilt_buckets():
    """The course's answer to 07's exercise 1: the buckets ``deep_mlp()`` gets after the rebuild with
    ``bucket_cap_mb=0.25``. Each 256 x 256 fp32 weight is exactly 0.25 MiB, so with its bias it closes a bucket of
    its own (the last layer's bias and weight ride along in bucket 0); the first layer's are left for the last.
    Introduced in 07_buckets_and_overlap (used when ``USE_SOLUTION = True``)."""
    return 7


def check_rebuilt_buckets(predicted, layout, cap_mb=0.25, section_layout=None):
    """Self-check of 07's exercise 1: is ``predicted`` the number of buckets in ``layout`` (``BucketLog.layout(1)``,
    the rebuilt buckets of ``deep_mlp()`` with ``bucket_cap_mb=cap_mb``)? ``section_layout`` is section 2's rebuilt
    layout (``bucket_cap_mb=0.5``), to recognise its count. Raises ``AssertionError`` with a hint, never the number;
    prints one line (rank 0 only, inside a ``%%ddp`` cell) when it is right. Introduced in 07_buckets_and_overlap.
    """
    __tracebackhide__ = True
    actual = len(layout)
    if predicted is None:
        raise AssertionError("predicted_buckets is still None: write the number of buckets you expect after the "
                             f"rebuild with bucket_cap_mb={cap_mb}, then run the cell.")
    try:
        value = float(predicted)
    except (TypeError, ValueError):
        raise AssertionError(f"predicted_buckets must be a number of buckets, got {predicted!r}.") from None
    if value == actual:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print("self-check passed: predicted_buckets is the number of buckets DDP rebuilt with "
                  f"bucket_cap_mb={cap_mb}")
        return
    if value == 1:
        raise AssertionError("one bucket is iteration 0's layout. The question is the rebuilt one (iteration 1): "
                             "cut the ready order each time a bucket reaches bucket_cap_mb.")
    if section_layout is not None and value == len(section_layout):
        raise AssertionError("that is section 2's count, with twice the cap: with a smaller cap, do the buckets stay "
                             "as they were? A bucket closes once it reaches the cap (at or above it), and a "
                             "256 x 256 fp32 weight is exactly 0.25 MiB.")
    if section_layout is not None and value == 2 * len(section_layout):
        raise AssertionError("Halving the cap does not simply double section 2's count: a bucket closes once it "
                             "reaches the cap (at or above it), with the whole tensor that made it reach it, and a "
                             "256 x 256 fp32 weight is exactly 0.25 MiB.")
    numels = [n for _, n, _ in layout]
    total_mib = 4 * sum(numels) / 2**20
    if abs(value - total_mib / cap_mb) < 1 and value != actual:
        raise AssertionError(f"total size / cap ({total_mib:.2f} MiB / {cap_mb} MiB) assumes buckets cut at exactly "
                             "the cap. DDP never splits a tensor: a bucket closes once it reaches the cap, with the "
                             "whole tensor that made it reach it. Walk the ready order tensor by tensor.")
    raise AssertionError("not the number DDP built. Walk backward's ready order (last layer first, bias before "
                         f"weight), adding each tensor's bytes; a bucket closes as soon as it reaches {cap_mb} MiB.")


# The course's answer to 07's exercise 2: bucket 0 of the rebuilt ``Reordered`` model with
# bucket_cap_mb=0.25 (head is used last in forward, so its gradients are ready first).
REORDERED_BUCKET0 = ["head.bias", "head.weight", "blocks.3.bias", "blocks.3.weight"]


def check_bucket0_prediction(predicted, layout, registration):
    """Self-check of 07's exercise 2: is ``predicted`` (a list of parameter names) bucket 0 of the
    rebuilt layout?

    ``layout`` is ``BucketLog.layout(1)`` (``[(index, numel, names), ...]``) and ``registration``
    the names in ``named_parameters()`` order. Raises ``AssertionError`` with a hint; prints
    one line (rank 0 only, inside a ``%%ddp`` cell) when the prediction is right. Introduced in 07_buckets_and_overlap.
    """
    __tracebackhide__ = True
    actual = list(layout[0][2])
    if predicted is None:
        raise AssertionError("predicted_bucket0 is still None: write the parameter names you expect in bucket 0 "
                             "after the rebuild, as a list of strings such as ['embed.weight', ...].")
    predicted = list(predicted)
    unknown = [n for n in predicted if n not in registration]
    if unknown:
        raise AssertionError(f"{unknown} are not parameter names of this model; they are: {registration}.")
    if predicted == actual:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            # no names: the stored output of the lesson (USE_SOLUTION = True) must not give the answer away
            print(f"self-check passed: predicted_bucket0 is the bucket 0 DDP rebuilt ({len(actual)} tensors, in order)")
        return
    reverse = registration[::-1]
    if predicted == reverse[:len(predicted)]:
        raise AssertionError("that is the start of the reverse REGISTRATION order. After the rebuild the buckets "
                             "follow the order in which backward produced the gradients: which module does "
                             "forward use last?")
    if predicted == registration[:len(predicted)]:
        raise AssertionError("that is the registration order. Backward runs from the loss towards the input: "
                             "the gradients of the module forward used last are ready first.")
    if set(predicted) == set(actual):
        raise AssertionError("the right parameters, in the wrong order: within a Linear layer, which gradient does "
                             "backward finish first, the bias's or the weight's?")
    if set(predicted) < set(actual):
        raise AssertionError(f"bucket 0 holds more than that: it closes once it reaches bucket_cap_mb "
                             f"({len(actual)} tensors here). Add the next gradients in ready order.")
    if set(actual) < set(predicted):
        raise AssertionError("bucket 0 holds fewer parameters: a bucket closes as soon as its size reaches "
                             "bucket_cap_mb (at or above it): one 256 x 256 fp32 weight is exactly 262,144 bytes, "
                             "0.25 MiB, so it fills a 0.25 MiB bucket on its own, with what came before it.")
    raise AssertionError("not bucket 0. Bucket 0 is filled with the gradients backward produces first, until "
                         "it reaches bucket_cap_mb.")
