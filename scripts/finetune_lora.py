"""Fine-tune a causal LM with LoRA adapters under torchrun: DDP over the adapters, or FSDP2 over the frozen base
(16_fine_tuning_small_cards). Checkpoints with torch.distributed.checkpoint (DCP), resumable at any world size.

One node, 2 processes, the lesson's tiny Llama (random weights from --seed, nothing downloaded):
    torchrun --standalone --nproc-per-node=2 scripts/finetune_lora.py --model tiny --strategy ddp --steps 20

FSDP2 over the frozen base, a checkpoint every 5 steps; after a crash, the same line (with --resume) continues:
    torchrun --standalone --nproc-per-node=2 scripts/finetune_lora.py --model tiny --strategy fsdp --steps 20 \\
        --checkpoint-dir /tmp/ft --save-every 5 --resume

A job that restarts itself: torchrun restarts every rank when one dies, and --resume finds the last checkpoint:
    torchrun --standalone --nproc-per-node=2 --max-restarts=1 scripts/finetune_lora.py --model tiny \\
        --strategy fsdp --steps 20 --checkpoint-dir /tmp/ft --save-every 5 --resume

Two nodes x 1 process (MASTER: node 0's address; on one machine 127.0.0.1 with GLOO_SOCKET_IFNAME=lo):
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=1 --master-addr=$MASTER --master-port=29500 \\
        scripts/finetune_lora.py --model tiny --strategy fsdp --steps 20
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=1 --master-addr=$MASTER --master-port=29500 \\
        scripts/finetune_lora.py --model tiny --strategy fsdp --steps 20

Your own GPUs (NCCL, one rank per GPU; the model from a local folder or the hub), Llama 2 7B on 2 x 24 GB cards:
    torchrun --standalone --nproc-per-node=2 scripts/finetune_lora.py --model meta-llama/Llama-2-7b-hf \\
        --strategy fsdp --bf16 --lora-r 16 --block-size 512 --global-batch-size 8 --checkpoint-dir ckpt --resume
  What the FSDP path does, and needs: every rank reads the base into host memory (``from_pretrained``, in bf16
  under --bf16: 13.5 GB of RAM per rank for 7B, 27 GB for two ranks on one machine), wraps the targets in fp32
  adapters, then ``fully_shard`` (each decoder layer, then the root) moves one layer's weights at a time to its GPU
  and keeps 1/W of them: a GPU holds 6.3 GiB of the base at W = 2, never all of it; the host copy goes as it moves.
  tests/test_finetune_fits.py runs this build and one step of this line with fake tensors on a fake world of 2:
  the peak per rank is 6.3 GiB after the build and 16.2 GiB in forward and backward (micro-batch 4 x 512 tokens),
  under 85% of a 24 GiB card; the CUDA context, NCCL's buffers and the allocator's cache come on top, unmeasured.
  --checkpointing (activation checkpointing per decoder layer) lowers the activations for longer blocks or larger
  batches. At the end, rank 0 writes the adapters in peft's format (adapter_config.json, adapter_model.safetensors)
  in ckpt/ beside the DCP checkpoints (or in --adapter-dir): ``PeftModel.from_pretrained(base, "ckpt")`` loads them.
  The data is the course corpus, tokenized by characters: a real run replaces finetune_batch with its own data set
  and the model's tokenizer (a character id is a valid token id of any vocabulary of more than 100 entries, so the
  line above runs as it is, and measures speed and memory).

Rank 0 prints ``final_loss=<value>`` at the end (the last step's loss, averaged over the global batch), each rank
its tokens per second and peak memory (CUDA: max_memory_allocated; CPU: the process's peak resident set).
On gloo/CPU the final loss depends only on the options and the world size: the data of a step depends only on the
step (every world size sees the same global batch), and the checkpoint holds the adapters, AdamW's state and the
step, so a resumed run at the same world size equals the uninterrupted one to the last bit.
"""
import argparse
import os
import resource
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from course_utils.lora import add_lora, load_model, save_adapter, tiny_tokenizer, train_steps

OPTIONS = StateDictOptions(ignore_frozen_params=True)   # the base is reloaded from --model, never saved
# loading: the frozen keys are missing on purpose (dcp.load itself fails if a trainable one is)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (the lesson's Llama), a folder or a hub name")
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--lora-r", type=int, default=4)
    p.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x r")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated linear layer names")
    p.add_argument("--bf16", action="store_true",
                   help="the frozen base in bf16 (adapters and AdamW fp32); ddp: bf16 autocast on CUDA; fsdp: bf16 "
                        "shards of the base, bf16 compute, gradients reduced in fp32")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing per decoder layer (recompute in backward: less memory, ~1/3 slower)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="DCP checkpoints: <dir>/step_<N>, <dir>/latest")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="start from <checkpoint-dir>/latest if it exists")
    p.add_argument("--adapter-dir", default=None,
                   help="where the trained adapters go at the end, in peft's format (adapter_config.json, "
                        "adapter_model.safetensors); default: --checkpoint-dir; neither: not saved")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="for the tests: the last rank exits with an error before this step, in torchrun's first "
                        "attempt only (TORCHELASTIC_RESTART_COUNT=0)")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir (where the checkpoints are)")
    return args


def attempt_store():
    """The store for this attempt's process group, or None for init_process_group's own (env://).

    Since torch 2.5 the workers of a torchrun job use the agent's store (TORCHELASTIC_USE_AGENT_STORE=True), and
    that store outlives a restart with every key the failed attempt wrote. A restarted rank could read the dead
    rank 0's gloo (or NCCL) address from the first attempt before the new rank 0 writes its own, and fail with
    "Connection refused" (seen here 1 run in a few under load; pytorch/pytorch#135712). Each attempt gets its own
    key prefix, from the restart count torchrun gives every rank of the job.
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


def build(args, device, load_base=load_model):
    """The LoRA model and its optimizer, as this rank trains them.

    ``load_base(name, seed=, dtype=)`` returns the base in host memory (``load_model``: the tiny Llama from
    ``--seed``, or ``from_pretrained``); tests/test_finetune_fits.py passes one that builds Llama 2 7B's shape on
    ``meta`` and runs this function as it is. Under ``--bf16`` the frozen base is bf16 for both strategies; the
    adapters (and so AdamW's state) stay fp32. ddp: the whole model goes to the device, then DDP. fsdp:
    ``fully_shard`` on a mesh of this device, each decoder layer, then the root (embeddings, final norm, head),
    before anything is moved: FSDP2 moves one module's weights at a time to the device and keeps this rank's
    1/W of them, so the device never holds the whole base (nothing is left to move afterwards).
    """
    targets = targets_of(args)
    alpha = 2 * args.lora_r if args.lora_alpha is None else args.lora_alpha
    base_dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = load_base(args.model, seed=args.seed, dtype=base_dtype)
    model = add_lora(model, targets, r=args.lora_r, alpha=alpha, seed=args.seed)     # adapters in fp32
    model.train()                              # from_pretrained returns eval mode, where checkpointing is off
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()     # the embeddings are frozen: their output must still carry grad
    if args.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
        kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    return model, optimizer


def latest(checkpoint_dir):
    marker = Path(checkpoint_dir) / "latest"
    return Path(checkpoint_dir) / marker.read_text().strip() if marker.exists() else None


def save(model, optimizer, step, checkpoint_dir):
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    path = Path(checkpoint_dir) / f"step_{step}"
    dcp.save({"model": model_state, "optim": optim_state, "step": step}, checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:          # the marker moves only once every rank's files are written
        tmp = Path(checkpoint_dir) / "latest.tmp"
        tmp.write_text(path.name)
        os.replace(tmp, Path(checkpoint_dir) / "latest")
    dist.barrier()


def load(model, optimizer, path):
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    dcp.load(state, checkpoint_id=str(path))      # each rank reads the slices it owns at this world size
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=LOAD_OPTIONS)
    return state["step"]


def save_adapters(model, args, directory):
    """The trained adapters in peft's format, in ``directory``: ``adapter_model.safetensors`` and
    ``adapter_config.json``, loaded by ``PeftModel.from_pretrained(base, directory)``. Every rank takes part (under
    FSDP each holds 1/W of every adapter); the whole tensors come to rank 0's CPU only, and rank 0 writes them with
    course_utils.lora.save_adapter, as lesson 16 does from one process."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)          # {} on every rank but 0
    if dist.get_rank() == 0:
        alpha = 2 * args.lora_r if args.lora_alpha is None else args.lora_alpha
        base = None if args.model == "tiny" else args.model
        save_adapter(state, directory, targets_of(args), args.lora_r, alpha, base)
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
    _, data = tiny_tokenizer()
    data = data.to(device)
    model, optimizer = build(args, device)
    start = 0
    if args.resume and latest(args.checkpoint_dir) is not None:
        start = load(model, optimizer, latest(args.checkpoint_dir))
        if rank == 0:
            print(f"resumed from {latest(args.checkpoint_dir)} at step {start}, on {world_size} ranks", flush=True)
    if args.checkpoint_dir and rank == 0:
        Path(args.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    losses, t0 = [], time.perf_counter()
    tokens_per_step = args.global_batch_size * args.block_size
    step = start
    with torch.autocast("cuda", dtype=torch.bfloat16) if args.bf16 and device.type == "cuda" and \
            args.strategy == "ddp" else nullcontext():
        while step < args.steps:
            if args.fail_at_step == step and first_attempt and rank == world_size - 1:
                print(f"[rank {rank}] --fail-at-step {step}: exiting with an error (a simulated crash)", flush=True)
                os._exit(1)
            losses += train_steps(model, optimizer, data, step, step + 1, args.global_batch_size, args.block_size)
            step += 1
            if args.checkpoint_dir and ((args.save_every and step % args.save_every == 0) or step == args.steps):
                save(model, optimizer, step, args.checkpoint_dir)
            if rank == 0 and (step % args.log_every == 0 or step == args.steps):
                rate = (step - start) * tokens_per_step / (time.perf_counter() - t0)
                print(f"step {step:4d}  loss {losses[-1]:.4f}  {rate:,.0f} tokens/s", flush=True)
    seconds = time.perf_counter() - t0
    rate = (step - start) * tokens_per_step / seconds if step > start else 0.0
    print(f"[rank {rank}] {args.strategy}, {world_size} ranks on {device.type}: {rate:,.0f} tokens/s, "
          f"peak memory {peak_memory(device) / 2**20:,.0f} MiB", flush=True)
    adapter_dir = args.adapter_dir or args.checkpoint_dir
    if adapter_dir:
        save_adapters(model, args, adapter_dir)
    dist.barrier()
    if rank == 0 and losses:
        print(f"final_loss={losses[-1]:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
