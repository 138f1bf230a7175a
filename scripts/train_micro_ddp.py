"""Train the capstone's tiny character-level GPT with MicroDDP: the same code on one process,
one node or several nodes (11_capstone_micro_ddp).

Single process (no torchrun, world size 1):
    python scripts/train_micro_ddp.py --steps 50

One node, 4 processes:
    torchrun --standalone --nproc-per-node=4 scripts/train_micro_ddp.py --steps 50

Two nodes x 2 processes: run one line on each node; MASTER is node 0's address, reachable from node 1:
    torchrun --nnodes=2 --node-rank=0 --nproc-per-node=2 --master-addr=$MASTER --master-port=29500 \\
        scripts/train_micro_ddp.py --steps 50
    torchrun --nnodes=2 --node-rank=1 --nproc-per-node=2 --master-addr=$MASTER --master-port=29500 \\
        scripts/train_micro_ddp.py --steps 50
  To try it on one machine, run both lines there with MASTER=127.0.0.1 and GLOO_SOCKET_IFNAME=lo.

SLURM, 2 nodes with one torchrun per node (sbatch --nodes=2 --ntasks-per-node=1 job.sh):
    MASTER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun torchrun --nnodes="$SLURM_NNODES" --node-rank="$SLURM_NODEID" --nproc-per-node=2 \\
        --master-addr="$MASTER" --master-port=29500 scripts/train_micro_ddp.py --steps 50

Checkpoint every 50 steps; after a crash, the same line plus --resume continues where it stopped:
    torchrun --standalone --nproc-per-node=4 scripts/train_micro_ddp.py --steps 200 --compressor powersgd \\
        --checkpoint ckpt.pt --save-every 50 --resume
  The checkpoint holds the weights, AdamW's moments, the step, MicroDDP's rebuilt bucket order, the
  options a resume must repeat (bucket cap, batch sizes, lr, seed, compressor and its warm-up, bf16: a
  --resume with other values is refused, since it would silently change the bucket layout or the data) and,
  with PowerSGD, every rank's error feedback and Q: on the CPU with gloo the resumed run is the
  uninterrupted one to the last bit (on GPUs to float rounding: NCCL and some CUDA kernels are not
  bit-deterministic). Without the bucket order a run of more than 2 ranks would differ in the last
  bits: the layout fixes the order in which the ring adds each element. PowerSGD's state is per
  rank, so it resumes only at the world size that saved it; the other compressors resume at any.
  --compressor powersgd sends plain all-reduces for each gradient's first --powersgd-warmup reductions
  (default 2, as torch's start_powerSGD_iter > 1 requires, and as MicroDDP's compressor="powersgd" does);
  --powersgd-warmup 0 compresses from step 0.

Rank 0 prints ``final_loss=<value>`` at the end: the loss of the last step, averaged over the
global batch. A --resume of a run that had already finished trains nothing and prints the final loss
its checkpoint recorded (a checkpoint past --steps is refused). On gloo/CPU it depends only on the
options and the world size, never on how the ranks are spread over nodes: the data is sharded by
global rank, and nothing is random but seeded. On NCCL the algorithm and channels depend on the
topology, so it agrees to float rounding.
Backend: NCCL when every local rank has its own GPU, else gloo on CPU.
"""
import argparse
import contextlib
import os
import re
import signal

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: see the comment in setup()
import torch.nn.functional as F

from course_utils.gpt import CharTokenizer, get_batch, load_checkpoint, load_corpus, make_gpt, save_checkpoint
from course_utils.micro_ddp import POWERSGD_WARMUP_STEPS, MicroDDP, PowerSGD


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=32, help="sequences per step, over all ranks")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per forward/backward")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fast on GPUs and CPUs with AMX/AVX512-BF16)")
    p.add_argument("--compressor", default=None, choices=[None, "fp16", "bf16", "powersgd"])
    p.add_argument("--powersgd-warmup", type=int, default=POWERSGD_WARMUP_STEPS,
                   help="with --compressor powersgd: plain all-reduces for each gradient's first N reductions "
                        "(torch's start_powerSGD_iter must be > 1: compressing the first, large gradients costs "
                        "accuracy); 0 compresses from the first step")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--checkpoint", default=None, help="checkpoint file: written by rank 0, atomically")
    p.add_argument("--save-every", type=int, default=0, help="save the checkpoint every N steps (0: at the end only)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.powersgd_warmup < 0:
        p.error(f"--powersgd-warmup {args.powersgd_warmup}: give 0 (compress from the first step) or more")
    return args


# What a checkpoint records of the run that saved it, and a resumed run must repeat: the bucket layout and
# PowerSGD's state depend on bucket_cap_mb and the compressor, the data order on the batch sizes and the seed,
# AdamW's moments on the learning rate. (The world size may change, except with PowerSGD: checked below.)
RESUME_OPTIONS = ("bucket_cap_mb", "global_batch_size", "micro_batch_size", "lr", "seed", "compressor",
                  "powersgd_warmup", "bf16")


def run_options(args):
    return {name: getattr(args, name) for name in RESUME_OPTIONS}


def resume_mismatch(saved, args):
    """Why ``args`` cannot resume a checkpoint that recorded ``saved`` (``run_options`` of its run), or None."""
    if saved is None:
        return ("it records no options (it was written by an older version of this script), so a resume could "
                "silently change them")
    now = run_options(args)
    changed = [f"--{name.replace('_', '-')} {saved.get(name)!r} there, {now[name]!r} here" for name in RESUME_OPTIONS
               if saved.get(name) != now[name]]
    return "its run used other options: " + "; ".join(changed) if changed else None


def to_device(state, device):
    """``state`` (nested dicts of tensors and plain data) with its tensors moved to ``device``."""
    if isinstance(state, dict):
        return {k: to_device(v, device) for k, v in state.items()}
    return state.to(device) if isinstance(state, torch.Tensor) else state


def local_layout(env=os.environ):
    """(local_rank, local_world_size) of this process: torchrun sets both; srun without torchrun sets
    SLURM_LOCALID and SLURM_NTASKS_PER_NODE (or SLURM_TASKS_PER_NODE, e.g. "2(x2)"). Never guessed
    from WORLD_SIZE: on 2 nodes x 2 GPUs that would compare 2 GPUs with 4 and fall back to the CPU."""
    local_rank = env.get("LOCAL_RANK", env.get("SLURM_LOCALID"))
    size = env.get("LOCAL_WORLD_SIZE") or env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if local_rank is None or size is None:
        missing = [name for name, v in (("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", size)) if v is None]
        raise SystemExit(f"{' and '.join(missing)} not set: with torchrun they are set for you; with srun alone set "
                         "LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=$SLURM_NTASKS_PER_NODE (processes on this node).")
    return int(local_rank), int(re.match(r"\d+", size).group())


def choose_device(local_rank, local_world_size, gpus):
    """cuda:local_rank when every process of this node has its own GPU, else the CPU."""
    return torch.device("cuda", local_rank) if gpus >= local_world_size else torch.device("cpu")


def setup():
    """rank, world_size, local_rank, device from torchrun's environment (or srun's, or a lone process).

    torch.distributed.nn is imported above, before the group exists, on purpose (torch 2.13): its
    functions take ``group=group.WORLD`` as a default argument, evaluated at import. Imported after
    init_process_group (torch._dynamo imports it, and the first torch.optim optimizer imports
    torch._dynamo), those defaults hold the default group for good: destroy_process_group() cannot
    free it, and its gloo threads live on into interpreter shutdown, where one that drops a finished
    work needs the GIL and aborts the rank ("terminate called without an active exception",
    SIGABRT after final_loss, now and then). Imported first, the defaults are None.
    """
    if "RANK" not in os.environ:  # plain `python script.py`: a world of one
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return 0, 1, 0, torch.device("cpu")
    local_rank, local_world_size = local_layout()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = choose_device(local_rank, local_world_size, gpus)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def main(argv=None):
    """The run: ``argv`` are the command line's arguments (None: ``sys.argv[1:]``)."""
    args = parse_args(argv)
    rank, world_size, local_rank, device = setup()
    micro_batch_size, global_batch_size = args.micro_batch_size, args.global_batch_size
    if global_batch_size % (micro_batch_size * world_size):
        raise SystemExit(f"--global-batch-size {global_batch_size} must be a multiple of micro-batch size x world "
                         f"size = {micro_batch_size * world_size}. Change one of them.")
    accum_steps = global_batch_size // (micro_batch_size * world_size)

    text = load_corpus()
    tokenizer = CharTokenizer(text)
    data = tokenizer.encode(text)
    compressor = (PowerSGD(rank=2, warmup_steps=args.powersgd_warmup) if args.compressor == "powersgd"
                  else args.compressor)
    model = MicroDDP(make_gpt(tokenizer.vocab_size, seed=args.seed).to(device),
                     bucket_cap_mb=args.bucket_cap_mb, compressor=compressor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    start, finished_loss = 0, None
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        state = load_checkpoint(args.checkpoint)
        mismatch = resume_mismatch(state.get("options"), args)
        if mismatch:
            raise SystemExit(f"--resume: {args.checkpoint} cannot be resumed by this run: {mismatch}. Resume with "
                             "the options it was saved with, or start over with a new --checkpoint.")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        saved = state.get("compressor")  # PowerSGD's error feedback and Q, one set per rank
        if saved is not None and model.compressor.state_dict():
            if len(saved) != world_size:
                raise SystemExit(f"{args.checkpoint} holds the {args.compressor} state of {len(saved)} ranks, and "
                                 f"this run has {world_size}: resume with {len(saved)} processes (e.g. torchrun "
                                 f"--nproc-per-node={len(saved)}), or start over with a new --checkpoint.")
            model.compressor.load_state_dict(to_device(saved[rank], device))  # this rank's own
        if state.get("bucket_order"):
            model.load_bucket_order(state["bucket_order"])  # the layout the saved run rebuilt, not a new one
        start = state["step"]
        if start > args.steps:
            raise SystemExit(f"--resume: {args.checkpoint} is at step {start}, past --steps {args.steps}: give "
                             f"--steps {start} or more to continue it, or start over with a new --checkpoint.")
        if start == args.steps:
            if "loss" not in state:  # written before the checkpoint recorded its loss
                raise SystemExit(f"--resume: the run in {args.checkpoint} already finished at step {start}, and the "
                                 "checkpoint (an older one) does not record its final loss. Give a larger --steps to "
                                 "train on, or start over with a new --checkpoint.")
            finished_loss = state["loss"]
        if rank == 0:
            print(f"resumed from {args.checkpoint} at step {start}")
            if start == args.steps:
                print(f"the run already finished at step {start} (--steps {args.steps}): nothing to train; its "
                      "final loss, from the checkpoint:")

    if rank == 0:
        print(f"world_size={world_size} accum_steps={accum_steps} micro_batch_size={micro_batch_size} "
              f"global_batch_size={global_batch_size} backend={dist.get_backend()}")
    # For tests/test_train_script.py only: with MICRO_DDP_TEST_PAUSE_AFTER_STEP=N, every rank stops once step N is
    # logged and checkpointed, until a signal ends it (the test kills a rank there: a crash mid-run, which can never
    # land after the run has ended). Unset, as in every real run, nothing waits.
    pause_after = int(os.environ.get("MICRO_DDP_TEST_PAUSE_AFTER_STEP") or 0)
    loss = torch.zeros((), device=device)
    for step in range(start, args.steps):
        loss = torch.zeros((), device=device)
        for micro_step in range(accum_steps):
            # the micro-batch depends on the global rank only, never on the node
            x, y = get_batch(data, step, rank * accum_steps + micro_step, micro_batch_size,
                             global_batch_size, model.module.cfg.block_size, seed=args.seed)
            x, y = x.to(device), y.to(device)
            last = micro_step == accum_steps - 1
            with (model.no_sync() if not last else contextlib.nullcontext()):  # sync on the last only
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    logits = model(x)
                micro_loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / accum_steps
                micro_loss.backward()
            loss += micro_loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss)  # the loss of the global batch: every rank prints the same story
        loss /= world_size
        done = step + 1
        if rank == 0 and (done % args.log_every == 0 or done == args.steps):
            print(f"step {done:4d}  loss {loss.item():.4f}", flush=True)
        if args.checkpoint and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                     "loss": loss.item(),  # what final_loss prints if a --resume finds the run finished
                     "bucket_order": model.bucket_order(), "options": run_options(args)}
            compressor_state = to_device(model.compressor.state_dict(), "cpu")
            if compressor_state:  # PowerSGD's differs from rank to rank (each its own error feedback): gather all
                state["compressor"] = [None] * world_size
                dist.all_gather_object(state["compressor"], compressor_state)
            if rank == 0:
                save_checkpoint(args.checkpoint, state)
            dist.barrier()  # nobody reads or overwrites the file before it is complete
        if done == pause_after:  # tests only (see pause_after above): wait here until a signal ends this rank
            if rank == 0:
                print(f"paused after step {done} (MICRO_DDP_TEST_PAUSE_AFTER_STEP)", flush=True)
            while True:
                signal.pause()
    if rank == 0:
        final = loss.item() if finished_loss is None else finished_loss
        print(f"final_loss={final!r}", flush=True)
    dist.barrier()  # no rank tears down its connections while a peer still has work in flight
    del model, optimizer  # their references to the group and its finished works go before the group does
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
