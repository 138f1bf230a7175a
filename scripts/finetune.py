"""Fine-tune a causal LM under torchrun: full fine-tuning, LoRA or QLoRA; DDP, ZeRO-2 or FSDP2; micro-batches with
gradient accumulation (16_fine_tuning_small_cards). The command scripts/will_it_fit.py prints for a plan it measured.
Checkpoints with torch.distributed.checkpoint (DCP), resumable at any world size.

One node, 2 processes, the lesson's tiny Llama (random weights from --seed, nothing downloaded), LoRA over DDP:
    torchrun --standalone --nproc-per-node=2 scripts/finetune.py --model tiny --method lora --strategy ddp --steps 20

Full fine-tuning with ZeRO-2, a global batch of 16 sequences as 2 ranks x 2 micro-batches of 4 (accumulation):
    torchrun --standalone --nproc-per-node=2 scripts/finetune.py --model tiny --method full --strategy zero2 \\
        --micro-batch-size 4 --accum-steps 2 --global-batch-size 16

A checkpoint every 5 steps; started again with the same line, --resume continues from the last one (at any world
size: a global batch that does not split any more is refused in one line, and --accum-steps then says how):
    torchrun --standalone --nproc-per-node=2 scripts/finetune.py --model tiny --method lora --strategy fsdp \\
        --steps 20 --checkpoint-dir /tmp/ft --save-every 5 --resume

A job that restarts itself: torchrun restarts every rank when one dies, and --resume finds the last checkpoint:
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 scripts/finetune.py --model tiny --method lora \\
        --strategy fsdp --steps 20 --checkpoint-dir /tmp/ft --save-every 5 --resume

Two nodes x 1 process (MASTER: node 0's address; on one machine 127.0.0.1 with GLOO_SOCKET_IFNAME=lo):
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 --master-addr=$MASTER --master-port=29500 \\
        scripts/finetune.py --model tiny --strategy fsdp --steps 20
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=1 --master-addr=$MASTER --master-port=29500 \\
        scripts/finetune.py --model tiny --strategy fsdp --steps 20

Your own GPUs (NCCL, one rank per GPU; the model from a local folder or the hub): the line will_it_fit printed,
e.g. LoRA of Llama 2 7B on 2 x 24 GB cards:
    torchrun --standalone --nproc-per-node=2 scripts/finetune.py --model meta-llama/Llama-2-7b-hf --method lora \\
        --strategy fsdp --precision mixed --lora-r 16 --seq-len 512 --micro-batch-size 4 --accum-steps 1 \\
        --global-batch-size 8 --checkpoint-dir ckpt --save-every 50 --resume
  tests/test_finetune_fits.py runs build() and one step of this line with fake tensors on a fake world of 2
  (FSDPMemTracker follows one forward per step: more --accum-steps add only the adapters' gradients, kept between
  micro-batches): the peak per rank is 6.3 GiB after the build and 16.2 GiB in forward and backward (micro-batch 4 x 512
  tokens), under 85% of a 24 GiB card; the CUDA context, NCCL's buffers and the allocator's cache come on top.

What each setting keeps in memory (scripts/will_it_fit.py measures exactly this layout):
  --method full: fp32 weights, gradients and AdamW moments. --precision mixed computes in bf16: torch.autocast over
    the fp32 weights with ddp and zero2, FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) with
    fsdp. --strategy ddp: a whole replica per rank; zero2: course_utils.zero.ShardedOptimizer(reduce_scatter=True)
    (lesson 12: the gradients and AdamW's state sharded, each bucket reduce-scattered in backward); fsdp:
    fully_shard per decoder layer, then the root.
  --method lora: the frozen base in bf16 (mixed) or fp32, fp32 adapters (and AdamW's state) on the targets; ddp or
    fsdp (with fsdp each GPU holds 1/W of the base; every rank reads the whole base into host memory first).
    DDP does not broadcast the frozen base at construction (init_sync=False): every rank loaded the same weights
    from the same file (or seed), so only the adapters are broadcast from rank 0.
  --method qlora: the base in 4 bits (bitsandbytes' NF4 with double quantisation, a CUDA GPU needed), prepared by
    peft's prepare_model_for_kbit_training (which casts the parameters that stay unquantised to fp32), peft's LoRA
    adapters; ddp only.
  AdamW is torch.optim.AdamW without a foreach/fused argument: on a GPU torch runs foreach=True, as measured.
  --checkpointing: activation checkpointing per decoder layer (recompute in backward: less memory, ~1/3 slower).

Accumulation: each rank runs --accum-steps micro-batches of --micro-batch-size sequences, each loss divided by
--accum-steps, and communicates once: DDP's no_sync() and FSDP2's set_requires_gradient_sync(False) skip the
gradient reduction of every micro-batch but the last; ZeRO-2 reduce-scatters each backward into its shards (where
they add up). Any two of --global-batch-size, --micro-batch-size, --accum-steps give the third
(global = micro x accum x world size); alone, --global-batch-size is one micro-batch per rank.

At the end rank 0 writes LoRA's adapters in peft's format (adapter_config.json, adapter_model.safetensors) in
--adapter-dir (default: --checkpoint-dir): ``PeftModel.from_pretrained(base, dir)`` loads them. Full fine-tuning
leaves its weights in the last DCP checkpoint (torch.distributed.checkpoint.format_utils.dcp_to_torch_save makes one
file of it). The data is the course corpus, tokenized by characters: a real run replaces finetune_batch with its own
data set and the model's tokenizer (a character id is a valid token id of any vocabulary of more than 100 entries, so
the lines above run as they are, and measure speed and memory).

Rank 0 prints ``final_loss=<value>`` at the end (the last step's loss, averaged over the global batch), each rank
its tokens per second and peak memory (CUDA: max_memory_allocated; CPU: the process's peak resident set).
On gloo/CPU in fp32 the final loss depends only on the options and the global batch: the data of a step depends only
on the step (every world size and split sees the same global batch), and the checkpoint holds the trained
parameters, AdamW's state and the step, so a resumed run at the same world size equals the uninterrupted one to the
last bit (tests/test_finetune_script.py).
"""
import argparse
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from course_utils.lora import (add_lora, causal_lm_loss, finetune_batch, load_model, save_adapter,  # noqa: E402
                               tiny_tokenizer)

OPTIONS = StateDictOptions(ignore_frozen_params=True)   # a frozen base is reloaded from --model, never saved
# loading: the frozen keys are missing on purpose (dcp.load itself fails if a trainable one is)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
METHODS = ("full", "lora", "qlora")
# the strategies each method runs (scripts/will_it_fit.py names no other)
STRATEGIES = {"full": ("ddp", "zero2", "fsdp"), "lora": ("ddp", "fsdp"), "qlora": ("ddp",)}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"finetune: {message} (python scripts/finetune.py --help lists the options)\n")


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (the lesson's Llama), a folder or a hub name")
    p.add_argument("--method", default="lora", choices=METHODS)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "zero2", "fsdp"],
                   help="full: ddp, zero2 or fsdp; lora: ddp or fsdp; qlora: ddp")
    p.add_argument("--precision", default="fp32", choices=["mixed", "fp32"],
                   help="mixed: bf16 compute (full: over fp32 weights; LoRA: a bf16 base); fp32: everything fp32")
    p.add_argument("--lora-r", type=int, default=4)
    p.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x r")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated linear layer names")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing per decoder layer (recompute in backward: less memory, ~1/3 slower)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per optimizer step, over every rank (default 16 when neither of the next two)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per rank per forward")
    p.add_argument("--accum-steps", type=int, default=None, help="micro-batches per rank per optimizer step")
    p.add_argument("--seq-len", "--block-size", dest="seq_len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="DCP checkpoints: <dir>/step_<N>, <dir>/latest")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="start from <checkpoint-dir>/latest if it exists")
    p.add_argument("--adapter-dir", default=None,
                   help="where LoRA's trained adapters go at the end, in peft's format (adapter_config.json, "
                        "adapter_model.safetensors); default: --checkpoint-dir; neither: not saved")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="for the tests: the last rank exits with an error before this step, in torchrun's first "
                        "attempt only (TORCHELASTIC_RESTART_COUNT=0)")
    args = p.parse_args(argv)
    if args.strategy not in STRATEGIES[args.method]:
        p.error(f"--method {args.method} runs with --strategy {' or '.join(STRATEGIES[args.method])}, not "
                f"{args.strategy}" + (" (LoRA's gradients and AdamW state are small: ZeRO-2 has nothing to shard "
                                      "that matters)" if args.strategy == "zero2" else ""))
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir (where the checkpoints are)")
    for flag in ("global_batch_size", "micro_batch_size", "accum_steps", "steps", "seq_len", "lora_r"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} {value}: give a whole number of at least 1")
    if args.method == "qlora" and not torch.cuda.is_available():
        p.error("--method qlora needs a CUDA GPU: its 4-bit base runs on bitsandbytes' CUDA kernels. On this machine "
                "use --method lora (a bf16 or fp32 base), which trains the same adapters")
    return args


def batch_sizes(args, world_size):
    """``(micro-batch, accumulation steps, global batch)`` from the options given (any two give the third:
    global = micro x accum x world size; none: a global batch of 16). SystemExit in one line when they disagree."""
    g, m, a = args.global_batch_size, args.micro_batch_size, args.accum_steps
    if g is None and m is None and a is None:
        g = 16
    if m is None:
        a = a or 1
        if g is None or g % (a * world_size):
            raise SystemExit(f"finetune: a global batch of {g} does not split into {a} accumulation step(s) on "
                             f"{world_size} ranks: give a multiple of {a * world_size}, or --micro-batch-size")
        m = g // (a * world_size)
    elif a is None:
        g = m * world_size if g is None else g
        if g % (m * world_size):
            raise SystemExit(f"finetune: a global batch of {g} is not a whole number of micro-batches of {m} on "
                             f"{world_size} ranks: give a multiple of {m * world_size}")
        a = g // (m * world_size)
    elif g is not None and g != m * a * world_size:
        raise SystemExit(f"finetune: --global-batch-size {g} is not --micro-batch-size {m} x --accum-steps {a} x "
                         f"{world_size} ranks = {m * a * world_size}: give two of the three")
    return m, a, m * a * world_size


def attempt_store():
    """The store for this attempt's process group, or None for init_process_group's own (env://).

    Since torch 2.5 the workers of a torchrun job use the agent's store (TORCHELASTIC_USE_AGENT_STORE=True), and
    that store outlives a restart with every key the failed attempt wrote. A restarted rank could read the dead
    rank 0's gloo (or NCCL) address from the first attempt before the new rank 0 writes its own, and fail with
    "Connection refused" (pytorch/pytorch#135712). Each attempt gets its own key prefix, from the restart count
    torchrun gives every rank of the job (tests/test_finetune_script.py holds it on a real TCPStore).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from datetime import timedelta

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def setup():
    """Process group and device: NCCL with one GPU per local rank, else gloo on the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if "RANK" not in os.environ:
        raise SystemExit("run me under torchrun (see the docstring: torchrun --standalone --nproc-per-node=2 ...)")
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend, kw = "nccl", {"device_id": device}
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        backend, kw = "gloo", {}
    store = attempt_store()
    if store is not None:
        kw.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, **kw)
    return device


def targets_of(args):
    return tuple(t.strip() for t in args.targets.split(",") if t.strip())


def alpha_of(args):
    return 2 * args.lora_r if args.lora_alpha is None else args.lora_alpha


def _mixed(args):
    return args.precision == "mixed"


def load_qlora(args, device):
    """QLoRA's model on ``device``: the base in 4 bits (NF4, double quantisation, bf16 or fp32 compute), prepared by
    peft's ``prepare_model_for_kbit_training`` (the parameters that stay unquantised cast to fp32), peft's LoRA
    adapters on the targets. ``--model tiny`` is saved to a temporary folder first (bitsandbytes quantises while
    ``from_pretrained`` loads)."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise SystemExit("finetune: --method qlora needs bitsandbytes: pip install bitsandbytes") from None
    import tempfile

    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from course_utils.lora import peft_lora_config

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16 if _mixed(args) else torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        source = args.model
        if args.model == "tiny":
            load_model("tiny", seed=args.seed).save_pretrained(tmp)
            source = tmp
        model = AutoModelForCausalLM.from_pretrained(source, quantization_config=quant, device_map={"": device})
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing,
                                            gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(args.seed)
    return get_peft_model(model, peft_lora_config(targets_of(args), args.lora_r, alpha_of(args),
                                                  None if args.model == "tiny" else args.model))


def build(args, device, load_base=load_model):
    """The model and optimizer as this rank trains them (see the docstring's memory layout).

    ``load_base(name, seed=, dtype=)`` returns the base in host memory (``load_model``: the tiny Llama from ``--seed``,
    or ``from_pretrained``); tests/test_finetune_fits.py passes one that builds Llama 2 7B's shape on ``meta`` and
    runs this function as it is. fsdp: ``fully_shard`` on a mesh of this device, each decoder layer, then the root,
    before anything is moved: FSDP2 moves one module's weights at a time to the device and keeps this rank's 1/W.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda_ids = [device.index] if device.type == "cuda" else None
    if args.method == "qlora":
        model = load_qlora(args, device)
        model.train()
        _broadcast_trainable(model)
        return DDP(model, device_ids=cuda_ids, init_sync=False), _adamw(model, args)
    lora = args.method == "lora"
    base_dtype = torch.bfloat16 if lora and _mixed(args) else torch.float32
    model = load_base(args.model, seed=args.seed, dtype=base_dtype)
    if lora:
        model = add_lora(model, targets_of(args), r=args.lora_r, alpha=alpha_of(args), seed=args.seed)  # fp32 adapters
    model.train()                              # from_pretrained returns eval mode, where checkpointing is off
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if lora:
            model.enable_input_require_grads()     # the embeddings are frozen: their output must still carry grad
    if args.strategy == "ddp":
        model = model.to(device)
        if lora:        # the base is every rank's own copy of the same file: broadcast only what trains
            _broadcast_trainable(model)
            return DDP(model, device_ids=cuda_ids, init_sync=False), _adamw(model, args)
        return DDP(model, device_ids=cuda_ids), _adamw(model, args)
    if args.strategy == "zero2":
        from course_utils.zero import ShardedOptimizer

        model = model.to(device)               # ShardedOptimizer broadcasts rank 0's weights (DDP's duty)
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, reduce_scatter=True, lr=args.lr)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh}
    if _mixed(args):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model, _adamw(model, args)


def _adamw(model, args):
    # no foreach/fused argument: torch's default (foreach=True on a GPU), the setting will_it_fit measures
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)


@torch.no_grad()
def _broadcast_trainable(model):
    for p in model.parameters():
        if p.requires_grad:
            dist.broadcast(p.data, src=0)


def _unwrapped(model):
    return getattr(model, "module", model)


def autocast(args, device):
    """bf16 autocast for full fine-tuning's replicas under --precision mixed; FSDP2 casts by its policy, and a LoRA
    base is already bf16 (its fp32 adapters cast their input themselves)."""
    if args.method == "full" and _mixed(args) and args.strategy in ("ddp", "zero2"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def train_step(model, optimizer, data, step, args, micro, accum, device):
    """One optimizer step: ``accum`` micro-batches of ``micro`` sequences on this rank (micro-batch ``rank * accum +
    k`` of the step's global batch, so the data depend only on the step), each loss divided by ``accum``, gradients
    reduced once. Returns the step's loss averaged over the global batch."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    total = torch.zeros((), device=device)
    for k in range(accum):
        last = k == accum - 1
        x, y = finetune_batch(data, step, rank * accum + k, micro, micro * accum * world, block_size=args.seq_len)
        if args.strategy == "fsdp":
            model.set_requires_gradient_sync(last)           # reduce-scatter only after the last micro-batch
        sync = model.no_sync() if args.strategy == "ddp" and not last else nullcontext()
        with sync:
            with autocast(args, device):
                loss = causal_lm_loss(model, x, y) / accum
            loss.backward()
        total += loss.detach()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(total, op=dist.ReduceOp.AVG)
    return total.item()


# -- checkpoints: DCP, at any world size ---------------------------------------------------------------------------
def latest(checkpoint_dir):
    marker = Path(checkpoint_dir) / "latest"
    return Path(checkpoint_dir) / marker.read_text().strip() if marker.exists() else None


def _zero2_state(model, optimizer, args, template=False):
    """ZeRO-2's checkpoint: the model's weights (the same on every rank: DCP writes them once) and AdamW's state
    whole, in torch's per-parameter format (``consolidate_state_dict``, gathered on rank 0 to save; on load every
    rank reads it whole into host memory and keeps its own slices). ``template``: zeros of the right shapes, which
    ``dcp.load`` fills."""
    model_state = get_model_state_dict(model)
    if template:
        state = {str(i): {"step": torch.zeros(()), "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape)}
                 for i, p in enumerate(optimizer.params)}
    else:
        full = optimizer.consolidate_state_dict(to=0)
        state = {} if full is None else {str(i): s for i, s in full["state"].items()}
    return {"model": model_state, "optim": state}


def save(model, optimizer, step, args):
    path = Path(args.checkpoint_dir) / f"step_{step}"
    if args.strategy == "zero2":
        state = _zero2_state(model, optimizer, args)
    else:
        model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
        state = {"model": model_state, "optim": optim_state}
    dcp.save({**state, "step": step}, checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:          # the marker moves only once every rank's files are written
        tmp = Path(args.checkpoint_dir) / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, Path(args.checkpoint_dir) / "latest")
    dist.barrier()


def load(model, optimizer, path, args):
    if args.strategy == "zero2":
        state = {**_zero2_state(model, optimizer, args, template=True), "step": 0}
        dcp.load(state, checkpoint_id=str(path))
        model.load_state_dict(state["model"])
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(g["params"])))}
                  for g in optimizer.param_groups]
        optimizer.load_state_dict({"state": {int(i): s for i, s in state["optim"].items()}, "param_groups": groups})
        return state["step"]
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=str(path))      # each rank reads the slices it owns at this world size
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=LOAD_OPTIONS)
    return state["step"]


def save_adapters(model, args, directory):
    """LoRA's trained adapters in peft's format in ``directory`` (``adapter_model.safetensors``,
    ``adapter_config.json``: ``PeftModel.from_pretrained(base, directory)`` loads them). Every rank takes part (under
    FSDP each holds 1/W of every adapter); rank 0 writes them (course_utils.lora.save_adapter, as lesson 16 does
    from one process; QLoRA's are peft's own, written by its save_pretrained)."""
    if args.method == "qlora":
        if dist.get_rank() == 0:
            _unwrapped(model).save_pretrained(str(directory))
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state = get_model_state_dict(model, options=options)          # {} on every rank but 0
        if dist.get_rank() == 0:
            base = None if args.model == "tiny" else args.model
            save_adapter(state, directory, targets_of(args), args.lora_r, alpha_of(args), base)
    if dist.get_rank() == 0:
        print(f"adapters saved in {directory}: PeftModel.from_pretrained(base, {str(directory)!r}) loads them",
              flush=True)
    dist.barrier()


def peak_memory(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024      # Linux: KiB


def main(argv=None):
    args = parse_args(argv)
    device = setup()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        micro, accum, global_batch = batch_sizes(args, world_size)
    except SystemExit:
        dist.destroy_process_group()
        raise
    _, data = tiny_tokenizer()
    data = data.to(device)
    model, optimizer = build(args, device)
    start = 0
    if args.resume and latest(args.checkpoint_dir) is not None:
        start = load(model, optimizer, latest(args.checkpoint_dir), args)
        if rank == 0:
            print(f"resumed from {latest(args.checkpoint_dir)} at step {start}, on {world_size} ranks", flush=True)
    if args.checkpoint_dir and rank == 0:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        print(f"{args.method}, {args.strategy}, {args.precision}: {world_size} ranks x {accum} micro-batch(es) of "
              f"{micro} = a global batch of {global_batch} sequences of {args.seq_len} tokens", flush=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    losses, t0 = [], time.perf_counter()
    tokens_per_step = global_batch * args.seq_len
    step = start
    while step < args.steps:
        if args.fail_at_step == step and first_attempt and rank == world_size - 1:
            print(f"[rank {rank}] --fail-at-step {step}: exiting with an error (a simulated crash)", flush=True)
            os._exit(1)
        losses.append(train_step(model, optimizer, data, step, args, micro, accum, device))
        step += 1
        if args.checkpoint_dir and ((args.save_every and step % args.save_every == 0) or step == args.steps):
            save(model, optimizer, step, args)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            rate = (step - start) * tokens_per_step / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s", flush=True)
    seconds = time.perf_counter() - t0
    rate = (step - start) * tokens_per_step / seconds if step > start else 0.0
    print(f"[rank {rank}] {args.method} {args.strategy}, {world_size} ranks on {device.type}: {rate:,.0f} tokens/s, "
          f"peak memory {peak_memory(device) / 2**20:,.0f} MiB", flush=True)
    adapter_dir = args.adapter_dir or args.checkpoint_dir
    if adapter_dir and args.method != "full":
        save_adapters(model, args, adapter_dir)
    dist.barrier()
    if rank == 0 and losses:
        print(f"final_loss={losses[-1]:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
