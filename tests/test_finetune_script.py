"""scripts/finetune.py (16_fine_tuning_small_cards; the command scripts/will_it_fit.py prints) under torchrun on the
CPU with the tiny Llama: every method and strategy that runs on a CPU (full fine-tuning with DDP, ZeRO-2 and FSDP2;
LoRA with DDP and FSDP2), gradient accumulation against one big batch, DDP on one node of 2 ranks and FSDP on two
"nodes" of 1 rank (static rendezvous), a rank killed under ``--max-restarts=1`` (the job restarts and resumes from
its DCP checkpoint by itself), a resume at another world size (FSDP's and ZeRO-2's checkpoints), and the adapters it
saves in peft's format. (Its memory at Llama 2 7B's size: tests/test_finetune_fits.py.)

Every run has the same global batch of 8 sequences a step, split differently, so all train the same model (LoRA's
runs one, full fine-tuning's another): a split with accumulation (2 ranks x 2 micro-batches of 2) must reach the
loss of one big batch per rank (2 ranks x 1 micro-batch of 4). Four jobs of launches (seven torchruns), each paying
the imports of every rank, so each serves as many checks as it can (module fixtures; the runs of a fixture side by
side):
- ``ddp``: LoRA, DDP on 1 node x 2, one micro-batch of 4, a DCP checkpoint at the end and ``--adapter-dir``;
- ``fsdp``: LoRA, FSDP on 2 nodes x 1 (two torchruns), 2 micro-batches of 2 (``set_requires_gradient_sync``),
  checkpoints at steps 2, 4 and 6: the reference of every FSDP check, the adapters written beside the checkpoints by
  global rank 0, and the step-2 checkpoint that the other-world-size test resumes on 1 rank;
- ``killed``: LoRA, FSDP on 1 node x 2, checkpoints every 2 steps, its last rank killed before step 5 in the first
  attempt, the second attempt resuming from step 4 by itself. Its first attempt is the uninterrupted run of 1 node
  x 2 up to step 4, which the node-layout test compares with ``fsdp``'s (the step-4 checkpoints, to the bit); its
  final loss must equal ``fsdp``'s;
- ``full``: full fine-tuning on 1 node x 2 with DDP (2 micro-batches of 2, ``no_sync``), ZeRO-2 (one micro-batch of
  4, checkpoints every 2 steps) and FSDP (2 micro-batches of 2): the same loss.
What needs no launcher runs the script's own functions in this process: the resumes on 1 rank (``main`` as the one
rank of a world of 1: what DCP reshards is the check, torchrun's part is the other runs'), the refused options, and
the per-attempt store on a real TCPStore in the agent's place.

    .venv/bin/python -m pytest tests/test_finetune_script.py -p no:randomly
"""
import importlib.util
import re
import shutil

import pytest
import torch
import torch.distributed as dist

from conftest import ROOT, finish, kill_process_group, retry_on_port_clash, start_torchrun, wait_until_listening

SCRIPT = ROOT / "scripts" / "finetune.py"
ARGS = ["--model", "tiny", "--steps", "6", "--global-batch-size", "8", "--seq-len", "32", "--log-every", "1"]
ONE_BIG = ["--micro-batch-size", "4"]                  # 2 ranks x 1 micro-batch of 4
ACCUMULATED = ["--micro-batch-size", "2"]              # 2 ranks x 2 micro-batches of 2 (accumulation)
FINAL = re.compile(r"final_loss=([0-9.]+)")
STEP = re.compile(r"step +(\d+) +loss ([0-9.]+)")   # not anchored: the ranks share torchrun's stdout
KILLED_AT = 4   # the killed job's last rank exits before step 5 in its first attempt, after the step-4 checkpoint


def _final(out, what):
    found = FINAL.findall(out)
    assert len(found) == 1, f"{what}: expected one final_loss line:\n{out[-4000:]}"
    return float(found[0])


def _steps(out):
    """{step: the loss rank 0 printed} (4 decimals)."""
    return {int(step): loss for step, loss in STEP.findall(out)}


def _check_reports(text, what):
    """Every run: each rank reports its speed and memory, and global rank 0 alone saves the adapters."""
    assert "tokens/s" in text and "peak memory" in text, f"{what}:\n{text[-3000:]}"
    assert text.count("2 ranks on cpu") == 2, f"{what}: each rank reports its speed and memory:\n{text[-3000:]}"
    assert text.count("adapters saved in") == 1, f"{what}: rank 0, and only rank 0, saves the adapters:\n{text[-3000:]}"


def _script():
    spec = importlib.util.spec_from_file_location("finetune", SCRIPT)
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


def _adapters(checkpoint):
    """The course's LoRA model of the tiny Llama with the adapters of a DCP checkpoint of the script, and those
    adapters ({name: tensor}), loaded in this process."""
    import torch.distributed.checkpoint as dcp

    from course_utils.lora import add_lora, load_model

    model = add_lora(load_model("tiny", seed=0), ("q_proj", "v_proj"), r=4, alpha=8)
    adapters = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    dcp.load({"model": adapters}, checkpoint_id=str(checkpoint))
    model.load_state_dict(adapters, strict=False)
    return model, adapters


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The two uninterrupted runs, launched side by side (one's imports overlap the other's; a 2-node launch waits
    for node 0's store before it starts node 1):
    - ``ddp``: DDP on one node of 2 ranks, a DCP checkpoint at the end, the adapters in --adapter-dir;
    - ``fsdp``: FSDP on two "nodes" of 1 rank (static rendezvous, the docstring's two lines), a checkpoint every 2
      steps, the adapters beside them.
    {strategy: {loss, dir (DCP checkpoints), adapters (their folder)}}; fsdp's also steps (rank 0's printed losses)."""
    root = tmp_path_factory.mktemp("references")
    ddp = start_torchrun("--standalone", "--nproc-per-node=2", script=SCRIPT,
                         script_args=[*ARGS, *ONE_BIG, "--strategy", "ddp", "--checkpoint-dir", root / "ddp",
                                      "--adapter-dir", root / "ddp-adapters"])

    def launch(port):
        def node(rank):
            return start_torchrun("--nnodes=2", f"--node-rank={rank}", "--nproc-per-node=1",
                                  "--master-addr=127.0.0.1", f"--master-port={port}", "--rdzv-backend=static",
                                  script=SCRIPT, script_args=[*ARGS, *ACCUMULATED, "--strategy", "fsdp",
                                                              "--checkpoint-dir", root / "fsdp", "--save-every", "2"])
        node0 = node(0)
        try:
            wait_until_listening(node0, port, "node 0")
            node1 = node(1)
            try:
                return finish(node0, "fsdp, node 0", timeout=800), finish(node1, "fsdp, node 1", timeout=800)
            finally:
                kill_process_group(node1)
        finally:
            kill_process_group(node0)

    try:
        out0, out1 = retry_on_port_clash(launch)
        ddp_text = finish(ddp, "ddp, 1 node x 2", timeout=800)
    finally:
        kill_process_group(ddp)
    _check_reports(ddp_text, "ddp, 1 node x 2")
    _check_reports(out0 + out1, "fsdp, 2 nodes x 1")
    assert FINAL.search(out1) is None, f"node 1 holds global rank 1, which prints no final_loss:\n{out1[-3000:]}"
    return {"ddp": {"loss": _final(ddp_text, "ddp"), "dir": root / "ddp", "adapters": root / "ddp-adapters"},
            "fsdp": {"loss": _final(out0, "fsdp, 2 nodes x 1"), "steps": _steps(out0), "dir": root / "fsdp",
                     "adapters": root / "fsdp"}}


@pytest.fixture(scope="module")
def ddp(references):
    return references["ddp"]


@pytest.fixture(scope="module")
def fsdp(references):
    return references["fsdp"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """FSDP on one node of 2 ranks under ``--max-restarts=1``, checkpoints every 2 steps, its last rank exiting
    with an error before step 5 in the first attempt: {out, returncode, dir}. Not asserted here: each test asserts
    what it needs (the node-layout test only the first attempt's part)."""
    ckpt = tmp_path_factory.mktemp("killed")
    proc = start_torchrun("--standalone", "--nproc-per-node=2", "--max-restarts=1", script=SCRIPT,
                          script_args=[*ARGS, *ACCUMULATED, "--strategy", "fsdp", "--checkpoint-dir", ckpt,
                                       "--save-every", "2", "--resume", "--fail-at-step", KILLED_AT])
    try:
        out = finish(proc, f"fsdp, a rank killed at step {KILLED_AT}, --max-restarts=1", timeout=800, check=False)
    finally:
        kill_process_group(proc)
    return {"out": out, "returncode": proc.returncode, "dir": ckpt}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Full fine-tuning on 1 node x 2, side by side: DDP and FSDP with 2 micro-batches of 2 per rank, ZeRO-2 with one
    of 4 and a checkpoint every 2 steps. {strategy: {loss, out}}, ZeRO-2's with its checkpoint folder."""
    root = tmp_path_factory.mktemp("full")
    runs = {"ddp": ACCUMULATED, "zero2": [*ONE_BIG, "--checkpoint-dir", root / "zero2", "--save-every", "2"],
            "fsdp": ACCUMULATED}
    procs = {s: start_torchrun("--standalone", "--nproc-per-node=2", script=SCRIPT,
                               script_args=[*ARGS, "--method", "full", "--strategy", s, *extra])
             for s, extra in runs.items()}
    try:
        outs = {s: finish(proc, f"full fine-tuning, {s}", timeout=800) for s, proc in procs.items()}
    finally:
        for proc in procs.values():
            kill_process_group(proc)
    return {s: {"loss": _final(out, f"full, {s}"), "out": out, "dir": root / s} for s, out in outs.items()}


def test_ddp_and_fsdp_train_the_same_adapters_with_or_without_accumulation(ddp, fsdp):
    """DDP with one micro-batch of 4 per rank, FSDP with 2 of 2 (its gradient sync skipped on the first)."""
    assert 2.0 < ddp["loss"] < 4.5, (ddp["loss"], fsdp["loss"])
    assert abs(ddp["loss"] - fsdp["loss"]) < 1e-4, (
        f"DDP over the adapters (one micro-batch of 4) and FSDP over the frozen base (2 accumulated micro-batches of "
        f"2) should reach the same loss: {ddp['loss']} (DDP), {fsdp['loss']} (FSDP)")


def test_full_fine_tuning_ddp_zero2_and_fsdp_train_the_same_model(full, ddp):
    """DDP and FSDP accumulate 2 micro-batches of 2 (no_sync, set_requires_gradient_sync), ZeRO-2 runs one of 4: the
    same global batch, the same training, within rounding. Every parameter trains: not LoRA's loss."""
    losses = {s: r["loss"] for s, r in full.items()}
    assert all(2.0 < v < 4.5 for v in losses.values()), losses
    assert max(losses.values()) - min(losses.values()) < 1e-4, losses
    assert abs(losses["ddp"] - ddp["loss"]) > 1e-3, (losses, ddp["loss"])
    for s, r in full.items():
        assert f"full, {s}, fp32: 2 ranks x {2 if s != 'zero2' else 1} micro-batch(es)" in r["out"], r["out"][-2000:]


def test_zero2_resumes_at_another_world_size(full, tmp_path, monkeypatch, capsys):
    """ZeRO-2's step-2 checkpoint of 2 ranks (AdamW's state whole, gathered at the save) resumed on 1 rank, with
    2 micro-batches of 4 where each of the 2 ranks ran one: the same global batch."""
    shutil.copytree(full["zero2"]["dir"] / "step_2", tmp_path / "step_2")
    (tmp_path / "latest").write_text("step_2")
    out = _run_in_process(["--method", "full", "--strategy", "zero2", *ONE_BIG, "--checkpoint-dir", tmp_path,
                           "--resume"], monkeypatch, capsys)
    assert "resumed from" in out and "at step 2" in out and "on 1 ranks" in out, out[-3000:]
    assert abs(_final(out, "zero2 resumed at 1 rank") - full["zero2"]["loss"]) < 1e-4, (out[-2000:], full["zero2"])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_saved_adapters_load_in_peft_with_the_trained_logits(ddp, fsdp, strategy):
    """What the user loads (``PeftModel.from_pretrained`` on the base) computes what the script trained: the DCP
    checkpoint of the last step, loaded into the course's LoRA model."""
    from peft import PeftModel

    from course_utils.lora import finetune_batch, load_model, tiny_tokenizer

    run = {"ddp": ddp, "fsdp": fsdp}[strategy]
    folder = run["adapters"]
    found = sorted(p.name for p in folder.iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(found), f"{folder} holds {found}"
    trained, adapters = _adapters(run["dir"] / "step_6")
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


def test_two_nodes_of_one_rank_equal_one_node_of_two(fsdp, killed):
    """The killed job's first attempt ran 1 node x 2 uninterrupted up to its step-4 checkpoint (its crash comes
    after): the same losses and, to the bit, the same adapters as the 2 nodes x 1 run's step 4."""
    one_node = _steps(killed["out"])
    assert [one_node.get(s) for s in range(1, KILLED_AT + 1)] == [fsdp["steps"][s] for s in range(1, KILLED_AT + 1)], (
        f"the node layout must not change the loss on gloo: 2 nodes x 1 {fsdp['steps']}, 1 node x 2 {one_node}")
    _, two = _adapters(fsdp["dir"] / f"step_{KILLED_AT}")
    _, one = _adapters(killed["dir"] / f"step_{KILLED_AT}")
    assert any(v.abs().sum() > 0 for k, v in two.items() if "lora_B" in k), "step 4's B matrices are still zero"
    differ = sorted(k for k in two if not torch.equal(two[k], one[k]))
    assert not differ, f"the node layout must not change the training on gloo: step {KILLED_AT}'s {differ} differ"


def test_a_killed_rank_restarts_the_job_which_resumes_by_itself(fsdp, killed):
    out = killed["out"]
    assert killed["returncode"] == 0, f"the restarted job failed (exit code {killed['returncode']}):\n{out[-6000:]}"
    assert "a simulated crash" in out, out[-3000:]
    assert "resumed from" in out and f"at step {KILLED_AT}" in out, (
        f"the restarted job must resume from step {KILLED_AT}:\n{out[-4000:]}")
    assert _final(out, "crash and resume") == fsdp["loss"], (
        "a job resumed from its checkpoint at the same world size must end with the uninterrupted run's loss "
        f"({fsdp['loss']}, 2 nodes x 1; the layout test checks 1 node x 2 equals it up to step {KILLED_AT})")


def test_resume_at_another_world_size(fsdp, tmp_path, monkeypatch, capsys):
    """Resumes on 1 rank from the step-2 checkpoint that the FSDP reference run wrote on 2 ranks (the script's
    ``main`` in this process, as the one rank of a world of 1)."""
    shutil.copytree(fsdp["dir"] / "step_2", tmp_path / "step_2")
    (tmp_path / "latest").write_text("step_2")
    out = _run_in_process(["--strategy", "fsdp", "--checkpoint-dir", tmp_path, "--resume"], monkeypatch, capsys)
    assert "resumed from" in out and "at step 2" in out and "on 1 ranks" in out, out[-3000:]
    # 2 ranks summed the first 2 steps' gradients in another order than 1 rank would: rounding, not bit for bit
    assert abs(_final(out, "resumed at 1 rank") - fsdp["loss"]) < 1e-4, (out[-2000:], fsdp["loss"])


@pytest.mark.parametrize("argv, says", [
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--method", "qlora"], "--method qlora needs a CUDA GPU: its 4-bit base runs on bitsandbytes' CUDA kernels"),
    (["--method", "lora", "--strategy", "zero2"], "--method lora runs with --strategy ddp or fsdp, not zero2"),
    (["--accum-steps", "0"], "--accum-steps 0: give a whole number of at least 1"),
])
def test_a_refused_option_says_what_to_give_in_one_line(argv, says, monkeypatch, capsys):
    """The script's own argument parser, in this process: what ``python scripts/finetune.py ...`` runs before
    anything else (main parses first). QLoRA on a machine without CUDA, as every CI machine is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        _script().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("finetune: ") and says in err and err.count("\n") == 1, err


def test_any_two_batch_sizes_give_the_third():
    script, world = _script(), 2

    def sizes(**kw):
        args = script.parse_args([f"--{k.replace('_', '-')}={v}" for k, v in kw.items()])
        return script.batch_sizes(args, world)

    assert sizes() == (8, 1, 16)                                   # the default: one micro-batch per rank
    assert sizes(global_batch_size=32, micro_batch_size=2) == (2, 8, 32)
    assert sizes(global_batch_size=32, accum_steps=4) == (4, 4, 32)
    assert sizes(micro_batch_size=2, accum_steps=3) == (2, 3, 12)
    assert sizes(global_batch_size=32, micro_batch_size=2, accum_steps=8) == (2, 8, 32)
    for kw, says in ((dict(global_batch_size=30, micro_batch_size=4), "give a multiple of 8"),
                     (dict(global_batch_size=32, micro_batch_size=2, accum_steps=4), "give two of the three"),
                     (dict(global_batch_size=7), "give a multiple of 2")):
        with pytest.raises(SystemExit, match=says):
            sizes(**kw)


def test_a_restarted_attempt_never_reads_the_failed_attempts_addresses(killed, monkeypatch):
    """torchrun's agent store keeps the failed attempt's keys across a restart (pytorch#135712): without
    ``attempt_store`` a restarted rank can dial the dead rank 0's gloo address ("Connection refused").
    ``attempt_store`` gives each attempt its own keys in the agent's store: checked here, to the key, on a
    real TCPStore in the agent's place, with the environment torchrun gives a worker. That its store forms the
    restarted group under torchrun: the killed job, whose second attempt resumed through it."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    script = _script()
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert script.attempt_store() is None, "without the agent's store, init_process_group makes its own (env://)"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    stores = {}
    for attempt in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(attempt))
        stores[attempt] = script.attempt_store()
    assert None not in stores.values(), "under torchrun's agent store, each attempt needs a store of its own"
    keys = agent.num_keys()
    stores[0].set("rank_0", "the failed attempt's address")
    stores[0].get("rank_0")   # a set has no reply: a round trip on its own connection makes sure the server has it
    assert agent.num_keys() == keys + 1, "the attempt's keys must go to the agent's store, which every rank shares"
    assert not stores[1].check(["rank_0"]), "the restarted attempt sees the failed attempt's rank_0 key"
    stores[1].set("rank_0", "the new address")
    assert (stores[0].get("rank_0"), stores[1].get("rank_0")) == (b"the failed attempt's address", b"the new address")
    assert killed["returncode"] == 0 and "resumed from" in killed["out"], (
        f"the restarted attempt did not form its group:\n{killed['out'][-6000:]}")
