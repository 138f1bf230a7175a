"""The self-check of 16_fine_tuning_small_cards: ``check_lora_linear``.

Introduced in 16_fine_tuning_small_cards. It builds the learner's ``LoRALinear`` around a seeded ``nn.Linear``
(12 inputs, 10 outputs, a bias; r = 3, alpha = 6, so the scaling alpha / r = 2 differs from 1, from r / alpha and
from alpha) and checks, in this order, each with its own verdict:

1. the shapes: ``lora_A`` is r x in_features, ``lora_B`` is out_features x r;
2. at initialisation the output equals the base's exactly (B starts at zero), A is random at Kaiming uniform's
   scale (nn.Linear's and peft's init: standard deviation 1 / sqrt(3 x in_features), within a factor of 3), and one
   backward gives B a non-zero gradient and A a zero one (with A = 0 too, nothing would ever train; A = 0 with B
   random is the swapped initialisation, named as such);
3. only A and B are trainable (r x (in + out) numbers). Inside a process group of 2 or more ranks the wrapped
   layer is also put under DDP with lesson 09's byte counter, and the bytes of one backward are compared with
   4 x r x (in + out): a trainable base shows up on the wire;
4. with A and B set to random values, the output equals ``base(x) + (alpha / r) * x A^T B^T`` (the scaling
   missing, inverted, alpha or r alone are named), at r = 3, alpha = 6 and again at r = 16, alpha = 8, where
   alpha / r = 0.5 is not a whole number (``alpha // r`` gives 0 there and is named);
   then on a 3-D input (batch x tokens x in_features, what a transformer's projections receive): a forward that
   handles only 2-D input (``torch.mm``, ``x.t()``) is told so here, not deep inside transformers at step 7;
5. gradients reach A and B, and not the base;
6. ``merge()`` folds ``scaling * B @ A`` into the base weight (out x in): the merged output equals the unmerged
   one within 1e-5, and the update is not added twice;
7. on the lesson's tiny Llama, ``add_lora(model, lora_cls=cls)`` leaves the model's logits unchanged.
"""
import warnings

import torch
import torch.distributed as dist
from torch import nn

IN, OUT, R, ALPHA = 12, 10, 3, 6
# A second (r, alpha) where alpha / r is not a whole number: alpha // r (integer division) gives 0 there, and every
# wrong scaling named below gives a different value (1, r / alpha = 2, alpha = 8, r = 16).
R2, ALPHA2 = 16, 8


def _base(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(IN, OUT)


def _build(cls, r=R, alpha=ALPHA):
    base = _base()
    try:
        layer = cls(base, r=r, alpha=alpha)
    except NotImplementedError as exc:
        raise AssertionError(f"LoRALinear is not written yet ({exc}): write __init__, forward and merge") from None
    except TypeError as exc:
        raise AssertionError(f"LoRALinear(base, r={r}, alpha={alpha}) raised TypeError: {exc}. The constructor takes "
                             "the nn.Linear to wrap, then r and alpha") from None
    return layer


def _update(x, layer, scale):
    return scale * (x @ layer.lora_A.detach().t()) @ layer.lora_B.detach().t()


def check_lora_linear(cls):
    """Check a ``LoRALinear`` class (see the module docstring). Raises ``AssertionError`` with the reason."""
    layer = _build(cls)
    A, B = getattr(layer, "lora_A", None), getattr(layer, "lora_B", None)
    assert isinstance(A, nn.Parameter) and isinstance(B, nn.Parameter), (
        "self.lora_A and self.lora_B must be nn.Parameter (so that the optimizer and DDP see them)")
    assert tuple(A.shape) == (R, IN), f"lora_A has shape {tuple(A.shape)}; it should be r x in_features = {(R, IN)}"
    assert tuple(B.shape) == (OUT, R), f"lora_B has shape {tuple(B.shape)}; it should be out_features x r = {(OUT, R)}"
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(1))
    base = _base()
    try:
        with torch.no_grad():
            y0 = layer(x)
    except NotImplementedError as exc:
        raise AssertionError(f"forward is not written yet ({exc})") from None
    assert torch.equal(y0, base(x).detach()), (
        f"at initialisation the output differs from the base layer's by {(y0 - base(x)).abs().max():.3g}"
        + (": lora_B must start at zero (torch.zeros), so that B @ A = 0 and fine-tuning starts from the base model"
           if B.detach().abs().max() > 0 else ": with B = 0 the update is 0; forward should return base(x) + update"))

    _check_initial_a(A, B)

    trainable = [(n, p) for n, p in layer.named_parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for _, p in trainable)
    expected = R * (IN + OUT)
    extra = [n for n, p in trainable if p is not A and p is not B]
    wire = _bytes_on_the_wire(layer)
    if wire is not None:
        assert wire == 4 * expected, (
            f"under DDP one backward sent {wire} bytes; only A and B ({expected} fp32 numbers = {4 * expected} bytes) "
            f"should travel. Trainable besides A and B: {extra or 'none'}: freeze the base "
            "(base.weight.requires_grad_(False), and its bias)")
    assert not extra, (f"{n_trainable} trainable numbers where LoRA trains r x (in + out) = {expected}: {extra} "
                       "must be frozen (requires_grad_(False)); DDP would all-reduce their gradients every step")

    _check_initial_gradients(layer, x, A, B)

    y = _check_scaled_update(layer, x, R, ALPHA)
    _check_scaled_update(_build(cls, R2, ALPHA2), x, R2, ALPHA2)
    _check_batched_input(layer)

    assert y.requires_grad, ("the output does not require grad: the update must be computed from lora_A and lora_B "
                             "themselves (not from a detached copy), so that lora_A.grad or lora_B.grad is not empty")
    y.sum().backward()
    assert A.grad is not None and B.grad is not None and A.grad.abs().sum() > 0 and B.grad.abs().sum() > 0, (
        "after backward lora_A.grad or lora_B.grad is empty: the update must be computed from the parameters "
        "themselves (not from a detached copy)")

    before = layer(x).detach()
    try:
        layer.merge()
    except NotImplementedError as exc:
        raise AssertionError(f"merge is not written yet ({exc})") from None
    except RuntimeError as exc:
        raise AssertionError(f"merge raised RuntimeError ({str(exc).splitlines()[0]}): the base weight is "
                             "out x in, and so is B @ A (not A.T @ B.T)") from None
    with torch.no_grad():
        after = layer(x)
        merged_weight = [p for n, p in layer.named_parameters() if not p.requires_grad and p.dim() == 2]
    assert merged_weight, "the wrapped nn.Linear's weight should stay a frozen parameter of the layer"
    gap = (after - before).abs().max().item()
    if gap > 1e-5:
        twice = base(x).detach() + _update(x, layer, 2 * ALPHA / R)
        if torch.allclose(after, twice, atol=1e-4, rtol=1e-4):
            raise AssertionError("after merge() the update is counted twice: once in the merged weight and again "
                                 "in forward. Remember that the layer is merged, and stop adding the update")
        if torch.allclose(after, before - _update(x, layer, ALPHA / R), atol=1e-4, rtol=1e-4):
            raise AssertionError("after merge() the output equals the base's: the weight was not changed in place "
                                 "(add into self.base.weight under torch.no_grad())")
        raise AssertionError(f"after merge() the output moved by {gap:.3g}: the weight must grow by exactly "
                             "(alpha / r) * B @ A, the same update forward adds")
    _check_on_llama(cls)
    from course_utils.lora import LoRALinear

    solution = " (that was the course's solution, USE_SOLUTION = True: set it to False to check yours)" \
        if cls is LoRALinear else ""
    where = f", {wire} bytes per backward under DDP" if wire is not None else ""
    _say(f"check_lora_linear: equal to the base at initialisation; {expected} trainable numbers, r x (in + out)"
         f"{where}; scaled by alpha / r; merge() equal within 1e-5; a tiny Llama unchanged by add_lora{solution}.")


def _randomise(layer, r):
    """Set A and B to seeded random values (so that the update is not zero)."""
    with torch.no_grad():
        layer.lora_A.copy_(torch.randn(r, IN, generator=torch.Generator().manual_seed(2)))
        layer.lora_B.copy_(torch.randn(OUT, r, generator=torch.Generator().manual_seed(3)))


def _check_scaled_update(layer, x, r, alpha):
    """With A and B random, the output is base(x) + (alpha / r) * x A^T B^T; a wrong scaling is named. Returns the
    output (for the gradient check that follows)."""
    _randomise(layer, r)
    base = _base()
    y = layer(x)
    want = base(x).detach() + _update(x, layer, alpha / r)
    if torch.allclose(y, want, atol=1e-5, rtol=1e-5):
        return y
    for scale, words in ((alpha // r, f"the scaling is alpha // r = {alpha // r}, an integer division: use alpha / r "
                                      f"= {alpha / r} (a float; alpha // r is right only when r divides alpha)"),
                         (1.0, "the scaling alpha / r is missing"),
                         (r / alpha, "the scaling is inverted (r / alpha)"),
                         (float(alpha), "the update is scaled by alpha, not alpha / r"),
                         (float(r), "the update is scaled by r, not alpha / r")):
        if scale != alpha / r and torch.allclose(y, base(x).detach() + _update(x, layer, scale), atol=1e-5,
                                                 rtol=1e-5):
            raise AssertionError(f"with r = {r}, alpha = {alpha}: {words}. The update is (alpha / r) * x A^T B^T")
    raise AssertionError(f"with r = {r}, alpha = {alpha} and random A and B the output differs from base(x) + "
                         f"(alpha / r) * x A^T B^T by {(y - want).abs().max():.3g}: x goes through A (r x in) first, "
                         "then B (out x r)")


def _check_batched_input(layer):
    """``layer`` (built at R, ALPHA, with A and B random) on a 3-D input. A transformer's projections get (batch,
    tokens, in_features): forward must work on any leading dimensions. Checked here, with a plain hint, before
    step 7 runs the layer inside transformers' Llama."""
    x = torch.randn(2, 5, IN, generator=torch.Generator().manual_seed(5))
    want = (_base()(x) + _update(x, layer, ALPHA / R)).detach()
    hint = ("a transformer passes (batch, tokens, in_features). Write the update with x @ self.lora_A.T (matmul "
            "broadcasts over the leading dimensions) or F.linear(x, self.lora_A), not torch.mm or x.t(), which take "
            "2-D input only")
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")          # torch warns before it fails on x.T of a 3-D tensor
            y = layer(x)
    except (RuntimeError, IndexError, ValueError) as exc:
        raise AssertionError(f"forward fails on a 3-D input of shape {tuple(x.shape)} "
                             f"({str(exc).splitlines()[0]}): {hint}") from None
    assert tuple(y.shape) == tuple(want.shape) and torch.allclose(y, want, atol=1e-5, rtol=1e-5), (
        f"on a 3-D input of shape {tuple(x.shape)} forward returns "
        + (f"shape {tuple(y.shape)}, not {tuple(want.shape)}" if tuple(y.shape) != tuple(want.shape)
           else f"values off by {(y - want).abs().max():.3g}, while a 2-D input was right")
        + f": {hint}")


# The standard deviation of Kaiming uniform with a = sqrt(5) (nn.Linear's weight; peft 0.21.2's reset_lora_parameters
# for A with init_lora_weights=True): U(-b, b), b = 1 / sqrt(in_features), std b / sqrt(3). Accepted: a third of it to
# 3 times it (peft's "gaussian" init, std 1 / r, is 2 times it here).
A_STD = 1 / (3 * IN) ** 0.5
A_BAND = (A_STD / 3, 3 * A_STD)


def _check_initial_a(A, B):
    """A starts random at Kaiming uniform's scale: not zero (then B's gradient is zero too and nothing ever trains)
    and not far larger or smaller (the first steps' updates scale with A)."""
    std = A.detach().float().std().item()
    assert A.detach().abs().max() > 0 or B.detach().abs().max() == 0, (
        "lora_A starts at zero and lora_B random: the two initialisations are swapped. The output still equals the "
        "base's, but the first step would move only A, through B's random values; LoRA and peft start the other way "
        "round, A random (nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))) and B at zero, so that training "
        "starts by moving B")
    assert A.detach().abs().max() > 0, (
        "lora_A starts at zero: with B = 0 too, neither A's nor B's gradient is ever non-zero and training never "
        "starts. Initialise lora_A randomly, as nn.Linear's weight: nn.init.kaiming_uniform_(self.lora_A, "
        "a=math.sqrt(5)); only lora_B starts at zero")
    assert A_BAND[0] <= std <= A_BAND[1], (
        f"lora_A starts with standard deviation {std:.3g}; Kaiming uniform (nn.Linear's init, and peft's) gives "
        f"{A_STD:.3g} for in_features = {IN}: use nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5)), not a "
        "fixed-scale normal")


def _check_initial_gradients(layer, x, A, B):
    """At initialisation (A random, B = 0) one backward gives B a non-zero gradient and A a zero one: training
    starts by moving B."""
    y = layer(x)
    assert y.requires_grad, ("the output does not require grad: the update must be computed from lora_A and lora_B "
                             "themselves (not from a detached copy), so that lora_A.grad or lora_B.grad is not empty")
    y.sum().backward()
    b_grad = 0.0 if B.grad is None else B.grad.abs().max().item()
    a_grad = 0.0 if A.grad is None else A.grad.abs().max().item()
    layer.zero_grad(set_to_none=True)
    assert b_grad > 0, (
        "at initialisation lora_B.grad is zero, so the first step cannot move B and training never starts: B's "
        "gradient is (x A^T)^T times the output's, so A must start random (not zero) and forward must use "
        "lora_B (not a detached copy)")
    assert a_grad == 0, (
        f"at initialisation lora_A.grad is {a_grad:.3g}, not zero: with B = 0, A's gradient (B^T times the "
        "output's) must be exactly zero; lora_B must start at zero")


def _say(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message)


def _bytes_on_the_wire(layer):
    """Bytes one backward of ``layer`` under DDP hands to the all-reduce (lesson 09's counter), or None outside
    a process group of 2 or more ranks."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from course_utils.hooks import ByteCounter

    copy = _build(type(layer))
    copy.load_state_dict(layer.state_dict())
    for (_, p), (_, q) in zip(layer.named_parameters(), copy.named_parameters()):
        q.requires_grad_(p.requires_grad)
    ddp = DDP(copy)
    counter = ByteCounter()
    ddp.register_comm_hook(dist.group.WORLD, counter.wrap(allreduce_hook))
    ddp(torch.ones(2, IN)).sum().backward()
    counter.close()
    return counter.bytes_per_step()[0]


def _check_on_llama(cls):
    from course_utils.lora import add_lora, load_model

    x = torch.randint(10, (2, 16), generator=torch.Generator().manual_seed(4))
    base = load_model("tiny", seed=0)
    try:
        wrapped = add_lora(load_model("tiny", seed=0), targets=("q_proj", "v_proj"), r=R, alpha=ALPHA, lora_cls=cls)
        with torch.no_grad():
            want, got = base(input_ids=x).logits, wrapped(input_ids=x).logits
    except (AttributeError, RuntimeError, TypeError) as exc:
        raise AssertionError(
            f"on the tiny Llama your class raised {type(exc).__name__}: {str(exc).splitlines()[0]}. Its q_proj and "
            "v_proj are nn.Linear layers without a bias: the layer must work on any nn.Linear, with or without a bias "
            "(base.bias is None there; base.requires_grad_(False) freezes whatever the base holds)") from None
    assert torch.equal(got, want), (f"the tiny Llama wrapped with add_lora(..., lora_cls=your class) gives other "
                                    f"logits (by {(got - want).abs().max():.3g}) at initialisation")
