"""scripts/will_it_fit.py refuses every bad input before measuring anything: exit code 2, one line on stderr that says
what to give, no traceback, nothing on stdout (each case below: malformed JSON, --lora-r 0, --targets foo_proj,
--seq-len 0, --cards 2x0, --cards -1x24, and the bound on the card search). Each case calls the script's main() in
this process (a fresh interpreter costs seconds of imports); one case runs the script as a user does, from a shell.

    .venv/bin/python -m pytest -q -n 0 tests/test_will_it_fit_inputs.py
"""
import importlib.util
import subprocess
import sys

import pytest

from conftest import ROOT
from course_utils.will_it_fit import MAX_CARDS, LlamaShape, WillItFitError, _card_counts, will_it_fit

SCRIPT = str(ROOT / "scripts" / "will_it_fit.py")
BASE = ["--model", "llama-2-7b", "--cards", "2x24GiB"]


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def run_main(capsys, *args):
    """The script's main(args) here: (exit code, stdout, stderr), as the shell would see them."""
    spec = importlib.util.spec_from_file_location("will_it_fit_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    try:
        code = script.main(list(args))
    except SystemExit as exc:   # argparse's own refusals
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


CASES = {   # name: (arguments after --model and --cards, what the one line must say)
    "lora-r 0": (["--lora-r", "0"], "--lora-r 0: give LoRA's rank, a whole number of at least 1 (as in --lora-r 16)"),
    "lora-r -4": (["--lora-r", "-4"], "--lora-r -4: give LoRA's rank"),
    "targets foo_proj": (["--targets", "foo_proj"], "--targets 'foo_proj': no layer foo_proj in a Llama-family "
                                                    "decoder; give some of q_proj,k_proj,v_proj,o_proj,"),
    "targets empty": (["--targets", ","], "--targets '': no layer named; give some of q_proj"),
    "seq-len 0": (["--seq-len", "0"], "--seq-len 0: give the tokens per sequence, a whole number of at least 1"),
    "micro-batch 0": (["--micro-batch", "0"], "--micro-batch 0: give the sequences per card per forward"),
    "global-batch-size 0": (["--global-batch-size", "0"], "--global-batch-size 0: give the sequences per optimizer "
                                                          "step, a whole number of at least 1"),
    "cards 2x0": (["--cards", "2x0"], "--cards '2x0': a card's memory must be more than 0 and at most 1024 GiB"),
    "cards -1x24": (["--cards", "-1x24"], "--cards '-1x24': the count must be at least 1, as in 2x16GiB"),
    "cards 0xRTX 3060": (["--cards", "0xRTX 3060"], "--cards '0xRTX 3060': the count must be at least 1"),
    "cards over the bound": (["--cards", "100x24"], f"--cards: 100 cards is more than the search's bound of "
                                                    f"{MAX_CARDS}: give at most {MAX_CARDS} cards, or raise "
                                                    "--max-cards"),
    "max-cards over its limit": (["--max-cards", "5000"], "--max-cards 5000: give at most 1024"),
    "max-cards 0": (["--max-cards", "0"], "--max-cards 0: give the most cards to search"),
    "seq-len not a number": (["--seq-len", "abc"], "argument --seq-len: invalid int value: 'abc'"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_bad_input_is_refused_in_one_line_before_any_measurement(name, capsys):
    args, says = CASES[name]
    code, out, err = run_main(capsys, *BASE, *args)
    assert code == 2, (name, code, out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, (name, err)
    assert err.startswith("will_it_fit: ") and says in err, (name, err)
    assert out == "" and "measuring" not in err, (name, out)


def test_a_bad_input_from_the_shell_is_one_line_and_exit_code_2():
    done = run_script(*BASE, "--seq-len", "abc")
    assert done.returncode == 2 and done.stdout == "", (done.returncode, done.stdout, done.stderr)
    assert done.stderr.startswith("will_it_fit: argument --seq-len: invalid int value: 'abc'") and \
        done.stderr.count("\n") == 1 and "--help" in done.stderr, done.stderr


def test_a_malformed_config_json_is_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,,}')
    code, _, err = run_main(capsys, "--model", str(bad), "--cards", "2x24")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{bad}: not valid JSON (line 1, column " in err and "give a transformers config.json" in err, err
    (tmp_path / "list.json").write_text("[1, 2]")
    code, _, err = run_main(capsys, "--model", str(tmp_path / "list.json"), "--cards", "2x24")
    assert code == 2 and "a JSON list, not an object" in err, err


def test_the_library_checks_the_same_inputs_before_measuring():
    shape = LlamaShape("tiny", vocab_size=64, d_model=32, n_layer=2, d_ff=64, n_head=4, n_kv_head=2)
    measured = []
    for kw in (dict(seq_len=0), dict(lora_r=0), dict(targets=("foo_proj",)), dict(cards=(2, 0)),
               dict(cards=(0, 16)), dict(cards="-1x24"), dict(max_cards=2000), dict(micro_batch=-1)):
        kw = {"cards": (2, 16), **kw}
        with pytest.raises(WillItFitError):
            will_it_fit(shape, method="lora", say=lambda *a: measured.append(a), workers=1, **kw)
    assert measured == [], "a bad input measured something before it was refused"


def test_the_card_search_tries_one_node_then_whole_nodes_up_to_its_bound():
    assert _card_counts(1, MAX_CARDS) == [2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64]
    assert _card_counts(8, 32) == [16, 24, 32] and _card_counts(64, 64) == []
