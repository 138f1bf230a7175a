"""Training a diffusion model data-parallel: a tiny UNet on generated data, and Stable Diffusion at true size.

Introduced in 18_diffusion_on_two_rtx_3060s.

- **The tiny UNet.** ``tiny_unet()`` is ``diffusers``' ``UNet2DConditionModel`` with Stable Diffusion 1.5's block
  types (cross-attention down and up blocks, a plain down and up block, a cross-attention mid block, GroupNorm) at a
  few hundred thousand parameters. ``diffusion_batch(step)`` generates a global batch of "latents" and "text
  embeddings" (random tensors with a little structure, nothing downloaded); ``noise_and_timesteps`` draws what the
  noise-prediction loss needs, from a generator the caller seeds. ``noise_prediction_loss`` is the loss of
  ``diffusers``' train_text_to_image.py: noise the latents with ``DDPMScheduler.add_noise``, predict the noise, MSE.
- **True size.** ``TRUE_SIZE_JOBS`` are the fake-tensor steps (``model_zoo.measure_model_step``) behind the lesson's
  tables: Stable Diffusion 1.5's UNet at 512 px, micro-batch 1 and 4. A step of the 860M UNet takes 20 to 80 s on a
  quiet 2-core CPU, more than a lesson cell may, so their results are stored in ``diffusion_true_size.json`` beside
  this module, written by ``python -m course_utils.diffusion --write`` (every job; ``--jobs`` some). The lesson
  measures one job live and requires the stored bytes; tests/test_diffusion.py measures another. ``rows(...)`` turns
  the stored steps into per-card peaks, strategy by strategy, as ``true_size.replica_phases`` counts lesson 14's.
  SDXL's UNet (2.6B) is counted, not measured: ``state_lower_bound`` (its model state alone already decides).
"""
import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from course_utils.true_size import GiB

__all__ = ["TINY_UNET", "tiny_unet", "diffusion_batch", "noise_and_timesteps", "noise_prediction_loss",
           "TRUE_SIZE_JOBS", "TABLE_PATH", "measure_job", "load_table", "rows", "ADAM8_BYTES", "ema_bytes",
           "encoder_params", "solution_largest_micro_batch", "RTX_3060_GIB", "USABLE", "unet_units", "verdict",
           "table_text", "cheapest", "diffusers_command", "lesson_command", "state_lower_bound"]

USABLE = 0.85          # of a card: what no tensor meter sees (CUDA context, allocator, NCCL), as lessons 14 and 16
RTX_3060_GIB = 12      # nvidia-smi: 12288MiB

# -- the tiny UNet ------------------------------------------------------------------------------------------------
TINY_UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=[32, 64],
                 down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
                 up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], cross_attention_dim=32, attention_head_dim=8,
                 norm_num_groups=8)
TEXT_TOKENS = 8         # the tiny "prompt": 8 embeddings of width cross_attention_dim


def tiny_unet(seed=0):
    """The lesson's UNet: ``UNet2DConditionModel(**TINY_UNET)``, its weights from ``seed`` (every rank: the same)."""
    from course_utils.model_zoo import _quiet

    _quiet()
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(**TINY_UNET)


def unet_units(model):
    """The modules FSDP2 shards one by one before the root: the UNet's down blocks, mid block, up blocks."""
    return list(model.down_blocks) + [model.mid_block] + list(model.up_blocks)


def diffusion_batch(step, global_batch_size, side=8):
    """Generated training data for ``step``: latents ``(global_batch_size, 4, side, side)`` (a smooth pattern per
    sample plus noise) and text embeddings ``(global_batch_size, TEXT_TOKENS, 32)`` that describe it. The same
    tensors on every rank and in one process, whatever the world size: a rank takes its slice."""
    g = torch.Generator().manual_seed(10_000 + step)
    freq = torch.rand(global_batch_size, 4, 1, 1, generator=g) * 3
    grid = torch.linspace(0, math.pi, side)
    latents = torch.sin(freq * grid.view(1, 1, -1, 1)) * torch.cos(freq * grid.view(1, 1, 1, -1))
    latents = latents + 0.1 * torch.randn(latents.shape, generator=g)
    text = torch.randn(global_batch_size, TEXT_TOKENS, TINY_UNET["cross_attention_dim"], generator=g)
    text[:, 0, :4] = freq.view(global_batch_size, 4)          # the "prompt" names the pattern's frequencies
    return latents, text


def noise_and_timesteps(generator, batch_size, side=8, num_train_timesteps=1000):
    """What the loss draws for a batch: Gaussian noise like the latents and one timestep per sample, uniform over
    the scheduler's steps, as train_text_to_image.py draws them, from ``generator``."""
    noise = torch.randn(batch_size, 4, side, side, generator=generator)
    timesteps = torch.randint(0, num_train_timesteps, (batch_size,), generator=generator)
    return noise, timesteps


_SCHEDULER = None


def noise_prediction_loss(model, latents, text, noise, timesteps):
    """train_text_to_image.py's loss: ``x_t = sqrt(a_t) x_0 + sqrt(1 - a_t) noise`` (``DDPMScheduler.add_noise``),
    the UNet predicts the noise from ``x_t``, ``t`` and the text, MSE in fp32."""
    global _SCHEDULER
    if _SCHEDULER is None:
        from diffusers import DDPMScheduler

        _SCHEDULER = DDPMScheduler(num_train_timesteps=1000)
    noisy = _SCHEDULER.add_noise(latents, noise, timesteps)
    pred = model(noisy, timesteps, encoder_hidden_states=text).sample
    return F.mse_loss(pred.float(), noise.float())


# -- true size ----------------------------------------------------------------------------------------------------
TABLE_PATH = Path(__file__).with_name("diffusion_true_size.json")
LORA_RANK = 4           # train_text_to_image_lora.py's --rank default


def _jobs():
    jobs = {}
    sd = dict(model="sd-1.5", resolution=512)
    for b, checkpoints in ((1, (False, True)), (4, (True,))):
        for ck in checkpoints:
            c = " + ckpt" if ck else ""
            common = dict(sd, micro_batch_size=b, checkpoint=ck)
            jobs[f"sd-1.5 b{b} replica{c}"] = dict(common, strategy="replica", mixed_precision=True)
            jobs[f"sd-1.5 b{b} FSDP2 W=2{c}"] = dict(common, strategy="fsdp2", world_size=2, mixed_precision=True)
        jobs[f"sd-1.5 b{b} LoRA replica + ckpt"] = dict(sd, micro_batch_size=b, checkpoint=True, strategy="replica",
                                                       lora=True)
    return jobs


# name -> what measure_job measures. "replica": one whole UNet (DDP's, and the start of ZeRO's counts), fp32 weights
# under bf16 autocast (accelerate's --mixed_precision=bf16, what diffusers' scripts run); "FSDP2": fully_shard per
# down/mid/up block and at the root, bf16 compute, fp32 reductions; "LoRA": the UNet frozen in bf16, adapters of rank
# LORA_RANK on every attention projection in fp32. AdamW's for-loop (foreach=False), its state made before the step.
TRUE_SIZE_JOBS = _jobs()


def measure_job(name):
    """One of ``TRUE_SIZE_JOBS`` measured now (fake tensors): ``{"forward": kinds, "backward": ..., "step": ...,
    "n_params", "n_trainable"}``, bytes by kind as ``true_size.measure_step`` returns them."""
    from course_utils.model_zoo import UNET_LORA_TARGETS, add_lora_by_suffix, measure_model_step, unet_spec

    job = dict(TRUE_SIZE_JOBS[name])
    spec = unet_spec(job.pop("model"))
    if job.pop("lora", False):
        job["modify"] = lambda m: add_lora_by_suffix(m, UNET_LORA_TARGETS, r=LORA_RANK, base_dtype=torch.bfloat16)
    r = measure_model_step(spec, **job)
    return {k: r[k] for k in ("forward", "backward", "step", "n_params", "n_trainable")}


def load_table(path=TABLE_PATH):
    """The stored measurements of ``TRUE_SIZE_JOBS`` (``python -m course_utils.diffusion --write`` made them)."""
    data = json.loads(Path(path).read_text())
    missing = sorted(set(TRUE_SIZE_JOBS) - set(data["jobs"]))
    if missing:
        raise RuntimeError(f"{path} lacks {missing}: run `python -m course_utils.diffusion --write`")
    return data


def encoder_params():
    """Parameters of each pipeline's frozen text encoder(s) and VAE, counted on ``meta`` from their configurations:
    ``{"sd-1.5": {"text encoder": n, "VAE": n}, "sdxl": {...}}``."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from course_utils.model_zoo import TEXT_ENCODERS, VAE, _quiet

    _quiet()
    out = {}
    with torch.device("meta"):
        vae = sum(p.numel() for p in AutoencoderKL(**VAE).parameters())
        for name in ("sd-1.5", "sdxl"):
            text = 0
            for cls, cfg in TEXT_ENCODERS[name]:
                model = {"CLIPTextModel": CLIPTextModel,
                         "CLIPTextModelWithProjection": CLIPTextModelWithProjection}[cls](CLIPTextConfig(**cfg))
                text += sum(p.numel() for p in model.parameters())
            out[name] = {"text encoder": text, "VAE": vae}
    return out


# 8-bit AdamW (bitsandbytes, what --use_8bit_adam selects): both moments in one byte each, plus one fp32 scale per
# block of 256 values per moment. Counted: bitsandbytes has no CPU kernels to measure.
ADAM8_BYTES = 2 + 2 * 4 / 256


def ema_bytes(n_params, world_size=1, sharded=False):
    """diffusers' ``EMAModel`` on the card: an fp32 copy of every parameter (a rank of a sharded model keeps the
    EMA of its own shards: 1/W)."""
    return 4 * n_params / (world_size if sharded else 1)


def _phase_totals(ph):
    return {p: ph[p]["total"] for p in ("forward", "backward", "step")}


def rows(table, model="sd-1.5", micro_batch_size=1, world_size=2, adam="AdamW", ema=False, encoders=0):
    """Per-card peaks, phase by phase, of each way to train ``model``'s UNet on ``world_size`` cards, from the stored
    steps (``load_table``): ``{label: {"forward", "backward", "step", "peak", "how"}}`` in bytes.

    Full fine-tuning (fp32 master weights, bf16 autocast): DDP (the replica + DDP's fp32 bucket copy of the
    gradients, which no meter sees), ZeRO-2 (``true_size.replica_phases`` on the replica: gradients and AdamW's
    moments 1/W, one 25 MiB bucket in backward), FSDP2 (measured), each without and with checkpointing. LoRA (bf16
    base, fp32 adapters): DDP on one replica + the adapters' bucket. ``adam="8-bit"``: AdamW's 8 B of moments per
    trainable parameter replaced by ``ADAM8_BYTES`` (sharded as the moments are). ``ema``: ``ema_bytes`` in every
    phase. ``encoders``: bytes of frozen encoders on the card in every phase (0: the latents precomputed)."""
    from course_utils.true_size import replica_phases

    jobs, out = table["jobs"], {}
    W = world_size
    for ck in (False, True):
        c = " + ckpt" if ck else ""
        rep = jobs.get(f"{model} b{micro_batch_size} replica{c}")
        fsdp = jobs.get(f"{model} b{micro_batch_size} FSDP2 W={W}{c}")
        lora = jobs.get(f"{model} b{micro_batch_size} LoRA replica{c}")
        if rep is not None:
            n = rep["n_trainable"]
            counted = replica_phases(dict(rep, foreach=False), W)
            for name in ("DDP", "ZeRO-2"):
                shards = W if name == "ZeRO-2" else 1
                extra = _extras(n, shards, adam, ema, sharded=name == "ZeRO-2") + encoders
                ph = {p: b + extra for p, b in counted[name].items()}
                out[f"{name}{c}"] = dict(ph, peak=max(ph.values()), how="counted on a measured replica")
        if fsdp is not None:
            n = fsdp["n_trainable"]
            extra = _extras(n, W, adam, ema, sharded=True) + encoders
            ph = {p: b + extra for p, b in _phase_totals(fsdp).items()}
            out[f"FSDP2{c}"] = dict(ph, peak=max(ph.values()), how="measured")
        if lora is not None:
            n = lora["n_trainable"]
            extra = 4 * n * (W > 1) + _extras(n, 1, adam, False, sharded=False) + encoders
            ph = {p: b + extra for p, b in _phase_totals(lora).items()}
            out[f"LoRA DDP{c}"] = dict(ph, peak=max(ph.values()), how="measured + bucket")
    return out


def state_lower_bound(n_params, world_size, adam="AdamW"):
    """Model state alone per card when FSDP2 shards it over ``world_size``: fp32 weights and gradients (4 + 4 B a
    parameter) and the optimizer's moments (8 B, or ``ADAM8_BYTES``), all 1/W. No activation, no gathered block, no
    buffer: any plan of full fine-tuning holds at least this on some phase, so a bound over the card decides."""
    moments = ADAM8_BYTES if adam == "8-bit" else 8
    return (4 + 4 + moments) * n_params / world_size


def _extras(n, shards, adam, ema, sharded):
    extra = 0.0
    if adam == "8-bit":
        extra -= (8 - ADAM8_BYTES) * n / shards
    elif adam != "AdamW":
        raise ValueError(f"adam={adam!r}: 'AdamW' or '8-bit'")
    if ema:
        extra += ema_bytes(n, shards, sharded)
    return extra


def verdict(peak, card_gib=RTX_3060_GIB, usable=USABLE):
    """A row's verdict on one card, as will_it_fit words it."""
    card = card_gib * GiB
    if peak <= usable * card:
        return "fits"
    return "no: inside the card, not the margin" if peak <= card else "no: over the card"


def table_text(rows_, card_gib=RTX_3060_GIB, usable=USABLE):
    """``rows(...)`` as a table in GiB per card: each phase, the peak, the headroom under ``usable`` of the card,
    the verdict and how the row was found."""
    lines = [f"{'plan':16}{'forward':>9}{'backward':>9}{'step':>9}{'peak':>8}{'headroom':>10}  {'verdict':37}how"]
    for label, r in rows_.items():
        head = (usable * card_gib * GiB - r["peak"]) / GiB
        lines.append(f"{label:16}" + "".join(f"{r[p] / GiB:9.2f}" for p in ("forward", "backward", "step"))
                     + f"{r['peak'] / GiB:8.2f}{head:+10.2f}  {verdict(r['peak'], card_gib, usable):37}{r['how']}")
    return "\n".join(lines)


def cheapest(rows_, card_gib=RTX_3060_GIB, usable=USABLE, kinds=("DDP", "ZeRO-2", "FSDP2", "LoRA DDP")):
    """The first row that fits, in the order a reader would try: no checkpointing before checkpointing (a third
    more compute), then DDP, ZeRO-2, FSDP2 (more communication each), among the labels starting with ``kinds``."""
    order = [f"{k}{c}" for c in ("", " + ckpt") for k in kinds]
    for label in order:
        if label in rows_ and verdict(rows_[label]["peak"], card_gib, usable) == "fits":
            return label
    return None


FSDP_UNITS = "CrossAttnDownBlock2D,DownBlock2D,UNetMidBlock2DCrossAttn,UpBlock2D,CrossAttnUpBlock2D"


def diffusers_command(hub, strategy, checkpoint, world_size, micro_batch_size, resolution=512, sdxl=False,
                      lora=False, lora_rank=LORA_RANK, accum_steps=1, adam="AdamW", ema=False):
    """The command line of ``diffusers``' example scripts (examples/text_to_image in the diffusers repository, not in
    its pip package) under ``accelerate launch`` (flags of accelerate 1.16's ``accelerate launch --help``) that
    trains the UNet of the pipeline ``hub`` as a row measured it: ``strategy`` "DDP", "ZeRO-2" (DeepSpeed's stage
    2) or "FSDP2" (one unit per down, mid and up block). Not run here: it needs the cards and the weights."""
    script = "train_text_to_image" + ("_lora" if lora else "") + ("_sdxl" if sdxl else "") + ".py"
    words = ["accelerate", "launch", "--mixed_precision", "bf16", "--num_processes", str(world_size)]
    if strategy == "FSDP2":
        words += ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
                  "--fsdp_transformer_layer_cls_to_wrap", FSDP_UNITS]
    elif strategy == "ZeRO-2":
        words += ["--use_deepspeed", "--zero_stage", "2"]
    elif world_size > 1:
        words += ["--multi_gpu"]
    words += [script, "--pretrained_model_name_or_path", hub or "PATH/TO/YOUR/PIPELINE", "--resolution",
              str(resolution), "--train_batch_size", str(micro_batch_size)]
    if accum_steps > 1:
        words += ["--gradient_accumulation_steps", str(accum_steps)]
    if lora:
        words += ["--rank", str(lora_rank)]
    if checkpoint:
        words.append("--gradient_checkpointing")
    if adam == "8-bit":
        words.append("--use_8bit_adam")
    if ema:
        words.append("--use_ema")
    return " ".join(words + ["--dataset_name", "YOUR_DATASET"])


def lesson_command(model, label, world_size, micro_batch_size, adam="AdamW", ema=False):
    """``diffusers_command`` for a row of ``rows`` (``label`` such as "FSDP2 + ckpt" or "LoRA DDP") of a named UNet."""
    from course_utils.model_zoo import UNET_HUB

    strategy = label.removeprefix("LoRA ").removesuffix(" + ckpt")
    return diffusers_command(UNET_HUB[model], strategy, label.endswith("+ ckpt"), world_size, micro_batch_size,
                             resolution=1024 if model == "sdxl" else 512, sdxl=model == "sdxl",
                             lora=label.startswith("LoRA"), adam=adam, ema=ema)


# -- the exercise -------------------------------------------------------------------------------------------------
def solution_largest_micro_batch(peak_at_1, peak_at_4, card_gib, usable=USABLE):
    """The course's answer to lesson 18's exercise: the largest micro-batch whose peak fits ``usable`` of a card of
    ``card_gib`` GiB, the peak taken as linear in the micro-batch through the two measured points (0 if none)."""
    per_sample = (peak_at_4 - peak_at_1) / 3
    fixed = peak_at_1 - per_sample
    budget = usable * card_gib * GiB
    if per_sample <= 0:
        return 0 if fixed > budget else None
    return max(0, math.floor((budget - fixed) / per_sample))


# -- writing the table --------------------------------------------------------------------------------------------
def _main(argv=None):
    parser = argparse.ArgumentParser(description="Measure the lesson's true-size steps with fake tensors (about "
                                                 "15 minutes on 2 cores) and store them beside this module.")
    parser.add_argument("--write", action="store_true", help=f"measure every job and write {TABLE_PATH.name}")
    parser.add_argument("--jobs", nargs="*", help="only these jobs (merged into the stored file)")
    parser.add_argument("--out", default=str(TABLE_PATH), help="where to write (default: beside this module)")
    args = parser.parse_args(argv)
    import time

    torch.set_num_threads(1)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"jobs": {}}
    names = args.jobs or list(TRUE_SIZE_JOBS)
    for name in names:
        t0 = time.perf_counter()
        data["jobs"][name] = measure_job(name)
        print(f"{name}: {data['jobs'][name]['step']['total'] / GiB:.3f} GiB at the step, "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        if args.write:
            data["torch"], data["diffusers"] = torch.__version__, __import__("diffusers").__version__
            out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    _main()
