"""scripts/finetune_lora.py (16_fine_tuning_small_cards) under torchrun on the CPU with the tiny Llama: one node of 2
ranks (DDP and FSDP), two "nodes" of 1 rank (static rendezvous), a rank killed under ``--max-restarts=1`` (the job
restarts and resumes from its DCP checkpoint by itself), a resume at another world size, and the adapters it saves
in peft's format. (Its memory at Llama 2 7B's size: tests/test_finetune_fits.py.)

Six torchruns, each paying the imports of every rank, so each serves as many checks as it can:
- ``straight`` (module fixture), DDP on 1 node x 2, with a DCP checkpoint at the end and ``--adapter-dir``: the
  reference loss, the same-loss check, and the adapters written where ``--adapter-dir`` says;
- ``straight``, FSDP on 1 node x 2, checkpoints at steps 3 and 6: the reference of every FSDP check, the adapters
  written beside the checkpoints, and the step-3 checkpoint that the other-world-size test resumes on 1 rank;
- two nodes of 1 rank (two torchruns); the killed rank (one torchrun, two attempts); the restarted attempt's store
  (a small script, not the fine-tuning one).
What needs no launcher runs the script's own functions in this process: the resume on 1 rank (``main`` as the one
rank of a world of 1: what DCP reshards is the check, torchrun's part is the other runs'), and the refused options.

    .venv/bin/python -m pytest tests/test_finetune_script.py -p no:randomly
"""
import importlib.util
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, finish, kill_process_group, retry_on_port_clash, start_torchrun, wait_until_listening

SCRIPT = ROOT / "scripts" / "finetune_lora.py"
ARGS = ["--model", "tiny", "--steps", "6", "--global-batch-size", "8", "--block-size", "32", "--log-every", "1"]
FINAL = re.compile(r"final_loss=([0-9.]+)")


def _final(out, what):
    found = FINAL.findall(out)
    assert len(found) == 1, f"{what}: expected one final_loss line:\n{out[-4000:]}"
    return float(found[0])


def _run(what, *torchrun_args, script_args=(), timeout=800):
    proc = start_torchrun(*torchrun_args, script=SCRIPT, script_args=[*ARGS, *script_args])
    try:
        return finish(proc, what, timeout=timeout)
    finally:
        kill_process_group(proc)


def _script():
    spec = importlib.util.spec_from_file_location("finetune_lora", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_in_process(script_args, monkeypatch, capsys):
    """The script's ``main`` in this process, as the one rank of a world of 1 that ``torchrun --standalone
    --nproc-per-node=1`` would start (its environment, gloo on loopback, the GPUs hidden as ``torchrun_env`` hides
    them; the store on a port the system picks). Returns what it printed."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0", "GLOO_SOCKET_IFNAME": "lo"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    threads = torch.get_num_threads()              # the script sets 1 thread per rank on the CPU
    try:
        _script().main([*ARGS, *map(str, script_args)])
    finally:
        torch.set_num_threads(threads)
        if dist.is_initialized():                  # main failed before destroying its group
            dist.destroy_process_group()
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Uninterrupted 6-step runs on one node of 2 ranks, per strategy: the references. Their checkpoints and adapters
    are kept: ``{strategy: final loss}``, ``dirs[strategy]`` (DCP checkpoints), ``adapters[strategy]``."""
    root = tmp_path_factory.mktemp("straight")
    out = {"dirs": {}, "adapters": {}}
    for strategy, extra in (("ddp", ["--adapter-dir", root / "ddp-adapters"]), ("fsdp", ["--save-every", "3"])):
        ckpt = root / strategy
        text = _run(f"{strategy}, 1 node x 2", "--standalone", "--nproc-per-node=2",
                    script_args=["--strategy", strategy, "--checkpoint-dir", ckpt, *extra])
        assert "tokens/s" in text and "peak memory" in text, text[-3000:]
        assert text.count("2 ranks on cpu") == 2, f"each rank reports its speed and memory:\n{text[-3000:]}"
        assert text.count("adapters saved in") == 1, f"rank 0, and only rank 0, saves the adapters:\n{text[-3000:]}"
        out[strategy] = _final(text, strategy)
        out["dirs"][strategy] = ckpt
        out["adapters"][strategy] = root / "ddp-adapters" if strategy == "ddp" else ckpt
    return out


def test_ddp_and_fsdp_train_the_same_adapters(straight):
    assert 2.0 < straight["ddp"] < 4.5, straight
    assert abs(straight["ddp"] - straight["fsdp"]) < 1e-4, (
        f"DDP over the adapters and FSDP over the frozen base should reach the same loss: {straight}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_saved_adapters_load_in_peft_with_the_trained_logits(straight, strategy):
    """What the user loads (``PeftModel.from_pretrained`` on the base) computes what the script trained: the DCP
    checkpoint of the last step, loaded into the course's LoRA model."""
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel

    from course_utils.lora import add_lora, finetune_batch, load_model, tiny_tokenizer

    folder = straight["adapters"][strategy]
    found = sorted(p.name for p in folder.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(found), f"{folder} holds {found}"
    trained = add_lora(load_model("tiny", seed=0), ("q_proj", "v_proj"), r=4, alpha=8)
    adapters = {k: v for k, v in trained.state_dict().items() if "lora_" in k}
    dcp.load({"model": adapters}, checkpoint_id=str(straight["dirs"][strategy] / "step_6"))
    trained.load_state_dict(adapters, strict=False)
    assert all(trained.get_submodule(k.rsplit(".", 1)[0]).lora_B.abs().sum() > 0 for k in adapters), (
        "the checkpoint's B matrices are still zero: the run trained nothing")
    loaded = PeftModel.from_pretrained(load_model("tiny", seed=0), str(folder))
    x, _ = finetune_batch(tiny_tokenizer()[1], 0, 0, 2, 2, block_size=32)
    with torch.no_grad():
        base = load_model("tiny", seed=0)(input_ids=x).logits
        want, got = trained(input_ids=x).logits, loaded(input_ids=x).logits
    assert (want - base).abs().max() > 1e-3, "the trained model still computes the base's logits"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: (
        f"{strategy}: PeftModel.from_pretrained(base, {folder}) does not compute the trained model's logits: {m}"))


def test_two_nodes_of_one_rank_equal_one_node_of_two(straight):
    def launch(port):
        def node(rank):
            return start_torchrun("--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1",
                                  "--master-addr=127.0.0.1", f"--master-port={port}", "--rdzv-backend=static",
                                  script=SCRIPT, script_args=[*ARGS, "--strategy", "fsdp"])
        node0 = node(0)
        try:
            wait_until_listening(node0, port, "node 0")
            node1 = node(1)
            try:
                return finish(node0, "node 0", timeout=400), finish(node1, "node 1", timeout=400)
            finally:
                kill_process_group(node1)
        finally:
            kill_process_group(node0)

    out0, _ = retry_on_port_clash(launch)
    assert _final(out0, "2 nodes x 1") == straight["fsdp"], "the node layout must not change the loss on gloo"


def test_a_killed_rank_restarts_the_job_which_resumes_by_itself(straight, tmp_path):
    out = _run("fsdp, a rank killed at step 4, --max-restarts=1", "--standalone", "--nproc-per-node=2",
               "--max-restarts=1",
               script_args=["--strategy", "fsdp", "--checkpoint-dir", tmp_path, "--save-every", "2", "--resume",
                            "--fail-at-step", "4"])
    assert "a simulated crash" in out, out[-3000:]
    assert "resumed from" in out and "at step 4" in out, f"the restarted job must resume from step 4:\n{out[-4000:]}"
    assert _final(out, "crash and resume") == straight["fsdp"], (
        "a job resumed from its checkpoint at the same world size must end with the uninterrupted run's loss")


def test_resume_at_another_world_size(straight, tmp_path, monkeypatch, capsys):
    """Resumes on 1 rank from the step-3 checkpoint that the FSDP reference run wrote on 2 ranks (the script's
    ``main`` in this process, as the one rank of a world of 1)."""
    shutil.copytree(straight["dirs"]["fsdp"] / "step_3", tmp_path / "step_3")
    (tmp_path / "latest").write_text("step_3")
    out = _run_in_process(["--strategy", "fsdp", "--checkpoint-dir", tmp_path, "--resume"], monkeypatch, capsys)
    assert "resumed from" in out and "at step 3" in out and "on 1 ranks" in out, out[-3000:]
    # 2 ranks summed the first 3 steps' gradients in another order than 1 rank would: rounding, not bit for bit
    assert abs(_final(out, "resumed at 1 rank") - straight["fsdp"]) < 1e-4, (out[-2000:], straight)


def test_resume_without_a_checkpoint_dir_is_refused(capsys):
    """The script's own argument parser, in this process: what ``python scripts/finetune_lora.py --resume`` runs
    before anything else (main parses first)."""
    with pytest.raises(SystemExit) as exit_:
        _script().parse_args(["--resume"])
    err = capsys.readouterr().err
    assert exit_.value.code != 0 and "--resume needs --checkpoint-dir" in err, err


RESTARTED = '''
import importlib.util, os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist

spec = importlib.util.spec_from_file_location("finetune_lora", sys.argv[1])
finetune_lora = importlib.util.module_from_spec(spec)
spec.loader.exec_module(finetune_lora)
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(2)  # the restarted rank 0 is slow to start: rank 1 meets the first attempt's keys alone
store = finetune_lora.attempt_store() if sys.argv[2] == "prefixed" else None
kw = {} if store is None else {"store": store, "rank": rank, "world_size": int(os.environ["WORLD_SIZE"])}
dist.init_process_group("gloo", timeout=timedelta(seconds=60), **kw)
t = torch.ones(1)
dist.all_reduce(t)
print(f"attempt {attempt} rank {rank} sum {t.item()}", flush=True)
if attempt == 0 and rank == 1:
    os._exit(3)  # the crash: torchrun restarts both ranks
dist.barrier() if attempt else time.sleep(30)
dist.destroy_process_group()
'''


def test_a_restarted_attempt_never_reads_the_failed_attempts_addresses(tmp_path):
    """CI failed the crash-and-resume test with "Connection refused": torchrun's agent store keeps the failed
    attempt's keys across a restart, and restarted rank 1 dialled the dead rank 0's gloo address. With
    ``attempt_store`` each attempt has its own prefix. (Without it, "plain" below fails this way 3 runs in 3 here.)"""
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    proc = start_torchrun("--standalone", "--nproc-per-node=2", "--max-restarts=1", script=script,
                          script_args=[SCRIPT, "prefixed"])
    try:
        out = finish(proc, "a restarted 2-rank job with attempt_store", timeout=300)
    finally:
        kill_process_group(proc)
    for r in (0, 1):
        assert f"attempt 1 rank {r} sum 2.0" in out, out[-3000:]
