"""will_it_fit measures each distinct fake-tensor step once: a cache keyed by everything that decides the step's bytes
(shape, kind of step, world size, method and precision, checkpointing, sequence, micro-batch, AdamW's setting, the
measuring code), read back byte for byte, refreshed when a file is cut short, skipped with --no-cache; and every step
it measures runs AdamW as scripts/finetune.py does on a GPU (foreach).

    .venv/bin/python -m pytest -q -n 0 tests/test_will_it_fit_cache.py
"""
import dataclasses
import importlib.util

from conftest import ROOT
from course_utils.true_size import TORCH_GPU_FOREACH, LlamaShape
from course_utils.will_it_fit import Cache, _jobs, will_it_fit

TINY = LlamaShape("tiny", vocab_size=64, d_model=32, n_layer=2, d_ff=64, n_head=4, n_kv_head=2)
KW = dict(seq_len=8, lora_r=4, workers=1, max_cards=2, checkpoints=(False,))


def test_every_setting_that_changes_a_step_changes_its_key(tmp_path):
    cache = Cache(tmp_path)
    base = dict(seq_len=8, micro_batch=1, lora_r=4, targets=("q_proj", "v_proj"), precision="mixed")
    variants = {"base": ("lora", 2, base), "seq": ("lora", 2, dict(base, seq_len=16)),
                "micro": ("lora", 2, dict(base, micro_batch=2)), "rank": ("lora", 2, dict(base, lora_r=8)),
                "targets": ("lora", 2, dict(base, targets=("q_proj",))),
                "fp32": ("lora", 2, dict(base, precision="fp32")),
                "full": ("full", 2, base), "W": ("lora", 4, base)}
    keys = {}
    for name, (method, W, kw) in variants.items():
        for job_name, job in _jobs(TINY, method, W, **kw).items():
            assert job[2]["foreach"] is TORCH_GPU_FOREACH, (name, job_name)      # AdamW as the script runs it
            keys.setdefault(cache.key(*job), []).append((name, job_name))
    wider = dataclasses.replace(TINY, d_model=64)
    for job in _jobs(wider, "lora", 2, **base).values():
        keys.setdefault(cache.key(*job), []).append(("wider", job[0]))
    shared = {k: v for k, v in keys.items() if len(v) > 1}
    # only the replica is shared between world sizes (one whole model per rank whatever W)
    assert all({n for n, _ in v} == {"base", "W"} and all(j.startswith("replica") for _, j in v)
               for v in shared.values()), shared
    renamed = dataclasses.replace(TINY, name="another name, the same shape")
    job = _jobs(TINY, "lora", 2, **base)["replica"]
    assert cache.key(*job) == cache.key(job[0], renamed, job[2]), "the name does not change a step's bytes"


def bytes_of(results):
    """A measurement without its duration (which a step measured again does not repeat)."""
    return {name: {k: v for k, v in r.items() if k != "seconds"} for name, r in results.items()}


def test_a_warm_run_reads_every_step_back_and_says_what_a_cold_run_costs(tmp_path):
    measured = []
    say = lambda done, total, running: measured.append(running)  # noqa: E731
    cold = will_it_fit(TINY, (2, 16), method="lora", say=say, cache=tmp_path, **KW)
    assert cold.cache["hits"] == 0 and cold.cache["total"] == len(cold.results) > 0
    assert "a cold run: every step measured; cached in" in cold.report()
    measured.clear()
    warm = will_it_fit(TINY, (2, 16), method="lora", say=say, cache=tmp_path, **KW)
    assert measured == [], "a warm run measured a step again"
    assert warm.results == cold.results and [r.peak for r in warm.rows] == [r.peak for r in cold.rows]
    assert warm.cache["hits"] == warm.cache["total"] == cold.cache["total"]
    assert f"{warm.cache['total']} of {warm.cache['total']} steps from the cache" in warm.report()
    assert "a cold run measures them in about" in warm.report()
    cut = sorted(tmp_path.glob("*.json"))[0]                        # a file cut short is measured again
    cut.write_text(cut.read_text()[:10])
    again = will_it_fit(TINY, (2, 16), method="lora", say=say, cache=tmp_path, **KW)
    assert again.cache["hits"] == again.cache["total"] - 1 and bytes_of(again.results) == bytes_of(cold.results)


def test_the_script_caches_under_the_user_s_cache_folder_unless_no_cache(tmp_path, monkeypatch, capsys):
    import json

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": TINY.d_model, "intermediate_size": TINY.d_ff,
              "num_attention_heads": TINY.n_head, "num_key_value_heads": TINY.n_kv_head,
              "num_hidden_layers": TINY.n_layer, "vocab_size": TINY.vocab_size}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = importlib.util.spec_from_file_location("will_it_fit_script", ROOT / "scripts" / "will_it_fit.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    args = ["--model", str(tmp_path), "--cards", "1x16", "--seq-len", "8", "--workers", "1"]   # one card: replicas only
    outs = []
    for extra in ([], [], ["--no-cache"]):
        assert script.main(args + extra) == 0
        outs.append(capsys.readouterr().out)
    folder = tmp_path / "micro-ddp" / "will_it_fit"
    assert any(folder.glob("*.json")), list(tmp_path.rglob("*"))
    assert "a cold run: every step measured" in outs[0] and "steps from the cache in " + str(folder) in outs[1]
    assert "cache" not in outs[2].splitlines()[-1], outs[2]
