"""Will it fit on my cards? One training step of your model measured at true size, on this CPU, in under a minute
(course_utils.will_it_fit; lessons 14 and 16 measure the same way with fake tensors).

LoRA of Llama 2 7B on two 24 GB cards; of Llama 3 8B on two RTX 3060 (any current NVIDIA card by name):
    python scripts/will_it_fit.py --model llama-2-7b --cards 2x24GiB --method lora
    python scripts/will_it_fit.py --model llama-3-8b --cards "2 x RTX 3060" --method lora

Full fine-tuning of Mistral 7B on eight A100 40 GB, sequences of 2048 tokens:
    python scripts/will_it_fit.py --model mistral-7b --cards 8xA100-40 --method full --seq-len 2048

Your own decoder's config.json (Llama, Mistral, Qwen2), or a hub name (its config.json only is downloaded):
    python scripts/will_it_fit.py --model path/to/config.json --cards "RTX 4090" --method qlora
    python scripts/will_it_fit.py --model Qwen/Qwen2.5-3B --cards 2x16 --method lora --lora-r 8

Any causal LM transformers builds (a config.json, or a hub name already in your huggingface cache), and the
Stable Diffusion UNets (sd-1.5, sd-2.1, sdxl, or a UNet's config.json; at their native resolution):
    python scripts/will_it_fit.py --model sd-1.5 --cards "2 x RTX 3060" --method full
    python scripts/will_it_fit.py --model path/to/gemma/config.json --cards "RTX 4090" --method lora

Then check the plan at tiny scale on 2 CPU ranks: that its strategy trains the same model as one process does (gloo,
a 2-block model of the same layer types), and that the printed command runs (the tiny Llama, 2 steps):
    python scripts/will_it_fit.py --model llama-2-7b --cards 2x24GiB --method lora --check

It prints, per strategy, the peak per card in each phase (forward, backward, optimizer step), the headroom against
85% of the card, and a verdict; then the cheapest plan that fits and the scripts/finetune.py command that runs it as
measured (its micro-batch, and accumulation steps up to --global-batch-size); when nothing fits, the cheapest change
that fits the same cards ("LoRA over a bf16 base does not fit ...; QLoRA (a 4-bit base) does") and the fewest cards
that fit (up to --max-cards). A bad input is refused in one line before anything is measured.

Each distinct step is measured once and kept in your cache folder (~/.cache/micro-ddp/will_it_fit, or under
$XDG_CACHE_HOME): a 7B plan that takes a minute the first time answers in seconds after; --no-cache measures again.
"""
import argparse
import re
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from course_utils.model_zoo import UNETS  # noqa: E402
from course_utils.true_size import LlamaShape  # noqa: E402
from course_utils.will_it_fit import (GLOBAL_BATCH, MAX_CARDS, MODELS, WillItFitError, check_plan,  # noqa: E402
                                      default_cache_dir, run_tiny, tiny_command, will_it_fit)

VALUED = ("--model", "--cards", "--method", "--seq-len", "--micro-batch", "--precision", "--lora-r", "--targets",
          "--workers", "--max-cards", "--global-batch-size")


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors in one line on stderr, as the tool's own (tests/test_will_it_fit_inputs.py)."""

    def error(self, message):
        self.exit(2, f"will_it_fit: {message} (python scripts/will_it_fit.py --help lists the options)\n")


def _join_values(argv):
    """``--cards -1x24`` as ``--cards=-1x24``: argparse would take a value starting with '-' for an option and
    answer "expected one argument"; joined, the tool itself says what is wrong with the value."""
    out, argv = [], list(argv)
    while argv:
        word = argv.pop(0)
        if word in VALUED and argv:
            word = f"{word}={argv.pop(0)}"
        out.append(word)
    return out


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help=f"{', '.join(list(MODELS) + list(UNETS))}, a config.json (a "
                                                  "transformers causal LM or a diffusers UNet), or a cached hub name")
    p.add_argument("--cards", required=True, help="count x memory (2x16GiB) or count x a card's name ('2 x RTX 3060', "
                                                  "2xrtx3060-8gb, 8xA100-80); one card: 'RTX 4090'")
    p.add_argument("--method", default="lora", choices=["full", "lora", "qlora"])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per card per forward")
    p.add_argument("--global-batch-size", type=int, default=GLOBAL_BATCH,
                   help="sequences per optimizer step; the command reaches it with accumulation steps (default "
                        f"{GLOBAL_BATCH})")
    p.add_argument("--precision", default="mixed", choices=["mixed", "fp32"],
                   help="mixed: bf16 compute (full: fp32 master + moments, bf16 weights and gradients; LoRA: a bf16 "
                        "base); fp32: everything in fp32")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--targets", default=None, help="LoRA's target modules, comma-separated (default: q_proj,v_proj; "
                                                   "a UNet's to_q,to_k,to_v,to_out.0)")
    p.add_argument("--workers", type=int, default=None, help="processes measuring at once (default: 2 if there are)")
    p.add_argument("--max-cards", type=int, default=MAX_CARDS,
                   help="when nothing fits, the most cards searched (2 ... 8, then whole nodes of 8; default "
                        f"{MAX_CARDS})")
    p.add_argument("--no-cache", action="store_true",
                   help="measure every step again instead of reading it from the cache folder")
    p.add_argument("--check", action="store_true",
                   help="run the chosen plan at tiny scale on 2 CPU ranks (gloo) against one process")
    return p.parse_args(_join_values(sys.argv[1:] if argv is None else argv))


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="DTensor random operators")
    targets = None if args.targets is None else tuple(t.strip() for t in args.targets.split(",") if t.strip())
    try:
        plan = will_it_fit(args.model, args.cards, method=args.method, seq_len=args.seq_len,
                           micro_batch=args.micro_batch, lora_r=args.lora_r, targets=targets,
                           precision=args.precision, workers=args.workers, max_cards=args.max_cards,
                           global_batch=args.global_batch_size,
                           cache=None if args.no_cache else default_cache_dir())
    except WillItFitError as exc:
        print(f"will_it_fit: {exc}", file=sys.stderr)
        return 2
    print(plan.report(), flush=True)
    row = plan.chosen or (plan.cheaper and plan.cheaper[1]) or plan.smallest    # the plan whose command it printed
    if args.check:
        if row is None:
            print("--check: no plan to check", file=sys.stderr)
            return 1
        if not isinstance(plan.shape, LlamaShape):
            print(f"--check trains a tiny Llama-family decoder; it has no tiny {plan.shape.name} to train "
                  "(lesson 18 trains a tiny UNet with DDP and FSDP2 against one process)", file=sys.stderr)
            return 1
        ok, diff, got, ref = check_plan(plan.shape, row.method, row.strategy, row.checkpoint, args.lora_r,
                                        plan.targets)
        print(f"check: {row.label} on 2 CPU ranks (gloo) against one process, a 2-block {plan.shape.name} with "
              f"the same layer types, {len(got)} steps: largest loss difference {diff:.1e} -> "
              f"{'the same training' if ok else 'NOT the same training'}", flush=True)
        return 0 if ok and run_command_at_tiny_scale(plan.command(row)[0]) else 1
    return 0


def run_command_at_tiny_scale(command):
    """The printed command itself, at tiny scale: 2 CPU ranks, the tiny Llama, 32 tokens, 2 steps (tiny_command)."""
    args = tiny_command(command)
    if args is None:
        print("check: the command is QLoRA, which needs a GPU (bitsandbytes' 4-bit kernels): not run here")
        return True
    print("check: the command above at tiny scale (the tiny Llama, 2 CPU ranks, 32 tokens, 2 steps, at most 2 "
          "micro-batches accumulated), 20-60 s:\n    torchrun " + " ".join(args), flush=True)
    rc, out = run_tiny(args)
    final = re.findall(r"final_loss=([0-9.]+)", out)
    if rc or not final:
        print(f"check: the command FAILED (exit code {rc}); its last lines:\n{out[-3000:]}")
        return False
    print(f"check: the command ran: final loss {float(final[-1]):.4f}")
    return True


if __name__ == "__main__":
    sys.exit(main())
