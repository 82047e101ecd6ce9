"""Hugging Face integration (issue 14): every architecture through transformers equals
phaseloop itself — logits to 1e-6 in fp32 (bf16: the same computation, compared at
bf16's resolution), greedy and sampled generate token for token, with and without the
cache, left-padded batches row for row; export / from_pretrained round trips; lm-eval
loglikelihoods equal phaseloop's own on the same strings."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from conftest import write_corpus
from safetensors import safe_open
from test_cli import TINY_TRAIN, one_line_error
from transformers import AutoModelForCausalLM, AutoTokenizer

from phaseloop import PRESETS, ModelConfig, build_model, registry
from phaseloop.cli import main
from phaseloop.data.tokenizer import ByteTokenizer
from phaseloop.hf.modeling import PhaseloopForCausalLM
from phaseloop.hf.tokenizer import hf_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

# every architecture and option: (name, preset, overrides)
CONFIGS = [
    ("rope", "rope-tiny", {}),
    ("rope-tied", "rope-tiny", {"tie_embeddings": True}),
    ("3pt", "3pt-tiny", {}),
    ("3pt-ablations", "3pt-tiny", {"learnable_offsets": True, "learnable_horn": True,
                                   "residual_rotation": True}),
    ("rope+3pt", "rope-tiny", {"n_phases": 3, "phase_rotation": True, "phase_norm": True,
                               "horn": True, "n_heads": 6, "n_kv_heads": 3}),
    ("universal", "universal-tiny", {}),
    ("universal-learned", "universal-tiny", {"step_signal": "learned", "use_rope": False}),
    ("universal-paper", "universal-paper-tiny", {}),  # relu FFN, LayerNorm, biases, no RoPE
    ("universal-act", "universal-act-tiny", {}),
    ("universal-act-accumulated", "universal-act-tiny", {"act_type": "accumulated"}),
    ("looped", "looped-tiny", {}),
    ("looped+3pt", "looped-tiny", {"n_phases": 2, "phase_rotation": True, "phase_norm": True,
                                   "horn": True}),
    ("hyperloop", "hyperloop-tiny", {}),
    ("hyperloop-sinkhorn", "hyperloop-tiny", {"hc_res": "sinkhorn"}),
    ("hyperloop-identity", "hyperloop-tiny", {"hc_res": "identity"}),
    ("hyperloop-pooled", "hyperloop-tiny", {"hc_transition": "pooled_mlp"}),
    ("hyperloop-per-layer", "hyperloop-tiny", {"hc_per_layer": True}),
    ("mhc", "mhc-tiny", {}),
]
# a registered architecture none of the above covers (a plugin's) runs at its defaults
CONFIGS += [(f"arch={a}", None, {}) for a in registry.arch_names()
            if a not in {PRESETS[p]["arch"] for _, p, _ in CONFIGS}]
IDS = [c[0] for c in CONFIGS]


def _trained_like(cfg: ModelConfig):
    """A model whose weights are not at their init (a zero-init path would hide bugs)."""
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (phaseloop model, folder written by save_pretrained)."""
    out = {}
    for name, preset, over in CONFIGS:
        cfg = ModelConfig.from_preset(preset, **over) if preset else ModelConfig(arch=name[5:], **over)
        model = _trained_like(cfg)
        d = tmp_path_factory.mktemp(name.replace("=", "-"))
        PhaseloopForCausalLM.from_decoder(model).save_pretrained(d)
        out[name] = (model, d)
    return out


def _ids(B=2, T=17, seed=1):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", IDS)
def test_logits_equal_fp32_and_bf16(saved, name):
    model, d = saved[name]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    assert isinstance(hf, PhaseloopForCausalLM)
    x = _ids()
    with torch.no_grad():
        want, got = model(x).logits, hf(x).logits
        assert (want - got).abs().max().item() <= 1e-6
        hf16 = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
        assert next(hf16.parameters()).dtype == torch.bfloat16
        torch.set_default_dtype(torch.bfloat16)  # phaseloop's model built in bf16, as from_pretrained does
        try:
            ref16 = build_model(model.cfg).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        ref16.load_state_dict(model.state_dict())
        w16, g16 = ref16(x).logits.float(), hf16(x).logits.float()
    assert (w16 - g16).abs().max().item() <= 1e-6  # the same bf16 computation
    assert (w16 - want).abs().max().item() < 0.1 * want.abs().max().item()  # and it is bf16 of fp32


@pytest.mark.parametrize("name", IDS)
def test_generate_greedy_cache_and_no_cache_equal_phaseloop(saved, name):
    model, d = saved[name]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    x = _ids(T=9)
    want = model.generate(x, 12, temperature=0)
    assert torch.equal(hf.generate(x, max_new_tokens=12, do_sample=False), want)
    assert torch.equal(hf.generate(x, max_new_tokens=12, do_sample=False, use_cache=False), want)


@pytest.mark.parametrize("name", IDS)
def test_left_padded_batch_equals_rows_alone(saved, name):
    model, d = saved[name]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    rows = [_ids(1, T, seed=T)[0] for T in (11, 6, 11, 3)]
    S = max(len(r) for r in rows)
    batch = torch.stack([torch.cat([torch.zeros(S - len(r), dtype=torch.long), r]) for r in rows])
    mask = torch.stack([torch.cat([torch.zeros(S - len(r)), torch.ones(len(r))]) for r in rows]).long()
    for use_cache in (True, False):
        out = hf.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False,
                          pad_token_id=0, use_cache=use_cache)
        for b, r in enumerate(rows):
            alone = model.generate(r[None], 8, temperature=0)[0]
            assert torch.equal(out[b, S - len(r):], alone), (b, use_cache)
    with torch.no_grad():  # logits of the real positions equal each row's own
        logits = hf(batch, attention_mask=mask, use_cache=False).logits
        for b, r in enumerate(rows):
            assert (logits[b, S - len(r):] - model(r[None]).logits[0]).abs().max() <= 1e-6


@pytest.mark.parametrize("name", ["rope", "3pt", "universal-act", "hyperloop"])
def test_sampling_equals_phaseloop_with_the_same_seed(saved, name):
    model, d = saved[name]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    x = _ids(T=5)
    torch.manual_seed(7)
    want = model.generate(x, 16, temperature=0.8, top_k=20)
    torch.manual_seed(7)
    got = hf.generate(x, max_new_tokens=16, do_sample=True, temperature=0.8, top_k=20, top_p=1.0)
    assert torch.equal(got, want)


def test_beam_search_reorders_the_cache(saved):
    """Beam search (cache reordered across beams) equals beam search without the cache."""
    _, d = saved["universal-act"]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    x = _ids(T=6)
    a = hf.generate(x, max_new_tokens=6, num_beams=3, do_sample=False)
    b = hf.generate(x, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(a, b)


def test_bad_masks_refused(saved):
    _, d = saved["rope"]
    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    x = _ids(T=6)
    right = torch.ones_like(x)
    right[:, -2:] = 0
    with pytest.raises(Exception, match="not on the left"):
        hf(x, attention_mask=right)


def test_one_copy_of_shared_and_tied_weights(saved):
    for name in ("rope-tied", "universal", "looped", "hyperloop"):
        model, d = saved[name]
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        unique = {id(p) for p in model.parameters()}
        assert len(keys) == len(unique), name
        if name == "rope-tied":
            assert "model.head.weight" not in keys and "model.embed.tok.weight" in keys
            hf = AutoModelForCausalLM.from_pretrained(d)
            assert hf.model.head.weight is hf.model.embed.tok.weight
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "phaseloop" and cfg["phaseloop"]["arch"] == model.cfg.arch


def test_buffers_after_load_equal_a_fresh_build(saved):
    """from_pretrained builds on the meta device: derived buffers are recomputed."""
    for name in ("3pt", "universal", "hyperloop", "mhc"):
        model, d = saved[name]
        hf = AutoModelForCausalLM.from_pretrained(d)
        mine = dict(model.named_buffers())
        for k, v in hf.model.named_buffers():
            assert torch.equal(v, mine[k]), (name, k)


def test_byte_tokenizer_equals_phaseloop():
    b, f = ByteTokenizer(), hf_tokenizer(ByteTokenizer())
    for s in ["hello world\n", "  two  spaces\tand tab", "héllo → 日本語 🎉", "", "\x00\x01\x7f"]:
        ids = f(s, add_special_tokens=False).input_ids
        assert ids == b.encode(s).tolist()
        assert f.decode(ids) == b.decode(ids)
    raw = [0xE6, 0x97, 65, 0xFF, 10]  # invalid UTF-8 decodes to U+FFFD in both
    assert f.decode(raw) == b.decode(raw)


# ---------------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("hfrun")
    text = write_corpus(d / "corpus.txt")
    out = d / "run"
    assert main(["train", *TINY_TRAIN, "--set", "tie_embeddings=true", "--data", str(text),
                 "--out", str(out)]) == 0
    return out


def test_export_from_pretrained_generate_equals_phaseloop(trained, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "configuration_phaseloop.py", "modeling_phaseloop.py",
            "phaseloop.json", "README.md"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    capsys.readouterr()
    assert main(["generate", str(trained), "--prompt", "the quick", "--temperature", "0",
                 "--max-new-tokens", "20"]) == 0
    want = capsys.readouterr().out.rstrip("\n")
    hf = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("the quick", return_tensors="pt").input_ids
    assert tok.decode(hf.generate(ids, max_new_tokens=20, do_sample=False)[0]) == want


def test_trust_remote_code_loads_without_importing_phaseloop_first(trained, tmp_path):
    out = tmp_path / "exported"
    assert main(["export", str(trained), "--out", str(out), "--dtype", "bfloat16"]) == 0
    code = ("import sys, torch\nfrom transformers import AutoModelForCausalLM\n"
            "assert 'phaseloop' not in sys.modules\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
            "print(type(m).__name__, next(m.parameters()).dtype)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["PhaseloopForCausalLM", "torch.bfloat16"]


@pytest.mark.parametrize("first", ["phaseloop", "transformers"])
def test_import_registers_with_auto_classes(first):
    other = "transformers" if first == "phaseloop" else "phaseloop"
    code = (f"import {first}\nimport {other}\nfrom transformers import AutoConfig, AutoModelForCausalLM\n"
            "c = AutoConfig.for_model('phaseloop', phaseloop={'arch': 'universal', 'n_layers': 1, 'act': True})\n"
            "m = AutoModelForCausalLM.from_config(c)\nprint(type(m).__name__, m.model.cfg.act)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["PhaseloopForCausalLM", "True"]


def test_export_quantized_equals_the_quantized_model(trained, tmp_path, capsys):
    from phaseloop.engine.checkpoint import load_run
    from phaseloop.quant.io import load_quantized_state_dict

    assert main(["quantize", str(trained), "--bits", "4", "--group-size", "32", "--windows", "2",
                 "--out", str(tmp_path / "q")]) == 0
    qfile = next((tmp_path / "q").glob("quant-*.safetensors"))
    # the report beside it, edited (or not JSON of an object): what the export records comes from the
    # file's own digested header (it took the report's word, or failed with a traceback)
    qfile.with_suffix(".json").write_text('{"bits": 8, "group_size": 128, "method": "gptq"}')
    out = tmp_path / "exported"
    assert main(["export", str(trained), "--out", str(out), "--quantized", str(qfile)]) == 0
    record = json.loads((out / "config.json").read_text())["phaseloop_quantization"]
    assert {k: record[k] for k in ("bits", "group_size", "method")} == {"bits": 4, "group_size": 32, "method": "rtn"}
    qfile.with_suffix(".json").write_text('"bits group_size method"')
    assert main(["export", str(trained), "--out", str(tmp_path / "again"), "--quantized", str(qfile)]) == 0
    model, _ = load_run(trained)
    x = _ids(T=12)
    with torch.no_grad():
        plain = model(x).logits
        load_quantized_state_dict(qfile, model)
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        assert hf.config.phaseloop_quantization["bits"] == 4
        got = hf(x).logits
        assert (got - model(x).logits).abs().max() <= 1e-6
        assert (got - plain).abs().max() > 1e-4  # the INT4 weights, not the originals


def test_export_bad_input_exit_2_nothing_written(trained, tmp_path, capsys):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    one_line_error(capsys, main(["export", str(trained), "--out", str(busy)]), "not empty")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    not_run = tmp_path / "notrun"
    not_run.mkdir()
    one_line_error(capsys, main(["export", str(not_run), "--out", str(tmp_path / "x")]), "config.json")
    one_line_error(capsys, main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]),
                   "does not exist")
    one_line_error(capsys, main(["export", str(trained), "--out", str(tmp_path / "y"), "--quantized",
                                 str(tmp_path / "missing.safetensors")]), "no such file")
    import shutil
    damaged = tmp_path / "damaged"
    shutil.copytree(trained, damaged)
    w = damaged / "checkpoint" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0xFF
    w.write_bytes(bytes(data))
    one_line_error(capsys, main(["export", str(damaged), "--out", str(tmp_path / "z")]), "differs")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists() and not (tmp_path / "z").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_missing_extra_one_line(monkeypatch, trained, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lm_eval" else real(name, *a))
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "lambada_local"]),
                   "pip install 'phaseloop[hf]'")


# ---------------------------------------------------------------------------- lm-eval
def _own_loglikelihood(model, tok, context: str, continuation: str, prefix: int) -> float:
    """phaseloop's own: encode as lm-eval does (whole minus context), one forward pass."""
    ctx = tok.encode(context).tolist()
    whole = tok.encode(context + continuation).tolist()
    cont = whole[len(ctx):]
    ctx = whole[:len(ctx)] or [prefix]
    seq = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = model(seq[:, :-1]).logits.double().log_softmax(-1)[0]
    return float(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))


def test_lm_eval_loglikelihoods_equal_phaseloop(trained, tmp_path):
    from phaseloop.engine.checkpoint import load_run
    from phaseloop.hf.harness import lm_eval_run

    docs = [{"text": "the quick brown fox jumps over the lazy dog"},
            {"text": "over the lazy dog. the quick brown fox"},
            {"text": "jumps over the"}, {"text": "é dog"}]
    inc = tmp_path / "tasks"
    inc.mkdir()
    (inc / "tiny.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    for name, kind, text, target, metric in (
            ("tiny_words", "loglikelihood", "{{text.split(' ')[:-1]|join(' ')}}",
             "{{' '+text.split(' ')[-1]}}", "acc"),
            ("tiny_roll", "loglikelihood_rolling", "", "{{text}}", "word_perplexity")):
        (inc / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {json.dumps(str(inc / 'tiny.jsonl'))}\noutput_type: {kind}\ntest_split: test\n"
            f"doc_to_text: {json.dumps(text)}\ndoc_to_target: {json.dumps(target)}\n"
            f"metric_list:\n  - metric: {metric}\n")
    res = lm_eval_run(trained, ["tiny_words", "tiny_roll"], include_path=str(inc), batch_size=3,
                      log_samples=True, write=False)
    model, _ = load_run(trained)
    tok = ByteTokenizer()
    worst = 0.0
    for s in res["samples"]["tiny_words"]:
        (context, continuation), = [tuple(a) for a in s["arguments"]]
        ll = s["resps"][0][0][0]
        worst = max(worst, abs(ll - _own_loglikelihood(model, tok, context, continuation, 10)))
    for s in res["samples"]["tiny_roll"]:  # each doc fits one window: conditioned on "\n"
        ll = s["resps"][0][0]
        text = s["doc"]["text"]
        worst = max(worst, abs(ll - _own_loglikelihood(model, tok, "", text, 10)))
    assert len(res["samples"]["tiny_words"]) == 4 and len(res["samples"]["tiny_roll"]) == 4
    assert worst < 1e-4, worst  # fp32 logits: sums of ~40 log-probs


def test_lm_eval_generate_until_on_a_tokenizer_without_eos(trained, tmp_path):
    """A run's bytes have no EOS (lm-eval decoded None into a stop string and failed): a
    generate_until task stops at its own ``until`` and ``max_gen_toks``, its text the
    greedy continuation `phaseloop generate` gives."""
    from phaseloop.engine.checkpoint import load_run
    from phaseloop.hf.harness import lm_eval_run
    from phaseloop.inference import Options, generate

    inc = tmp_path / "tasks"
    inc.mkdir()
    docs = [{"q": "the quick brown", "a": "x"}, {"q": "over the lazy dog. the", "a": "y"}]
    (inc / "g.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (inc / "tiny_gen.yaml").write_text(
        "task: tiny_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(inc / 'g.jsonl'))}\n"
        "output_type: generate_until\ntest_split: test\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs:\n  until: ['QQQ']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    res = lm_eval_run(trained, ["tiny_gen"], include_path=str(inc), batch_size=2, log_samples=True, write=False)
    model, _ = load_run(trained)
    tok = ByteTokenizer()
    for s in res["samples"]["tiny_gen"]:
        prompt = torch.tensor([tok.encode(s["doc"]["q"]).tolist()])
        g = generate(model, prompt, Options(max_new_tokens=8))
        assert s["resps"][0][0] == tok.decode(g.tokens[0].tolist()), s["doc"]


def test_lm_eval_command_local_tasks(trained, data_dir, capsys):
    assert main(["lm-eval", str(trained), "--tasks", "lambada_local,wikitext2_local", "--limit", "3",
                 "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "lambada_local" in out and "wikitext2_local" in out
    res = json.loads((trained / "lm_eval" / "results.json").read_text())
    assert set(res["results"]) == {"lambada_local", "wikitext2_local"}
    r = res["results"]
    assert 0 <= r["lambada_local"]["acc,none"] <= 1 and r["lambada_local"]["perplexity,none"] > 1
    assert 0 < r["wikitext2_local"]["bits_per_byte,none"] < 10
    assert "bits_per_byte" in (trained / "lm_eval" / "results.md").read_text()


def test_lm_eval_bad_input(trained, tmp_path, capsys, monkeypatch):
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "no_such_task_xyz"]),
                   "lm-eval ls tasks")
    monkeypatch.delenv("PHASELOOP_DATA_DIR", raising=False)
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "lambada_local", "--data-dir",
                                 str(tmp_path)]), "PHASELOOP_DATA_DIR")
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "lambada_local", "--batch-size", "0"]),
                   "positive")
    bad = tmp_path / "bad"
    (bad / "lambada").mkdir(parents=True)
    (bad / "wikitext-2").mkdir()
    (bad / "lambada" / "lambada_test.jsonl").write_text('{"text": "a b"}\n{"text": "cut sho')
    (bad / "wikitext-2" / "wiki.test.raw").write_bytes(b"\xff\xfe garbage")
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "lambada_local", "--data-dir", str(bad)]),
                   "lambada_test.jsonl line 2 is not a JSON object: the file is damaged")
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "wikitext2_local", "--data-dir", str(bad)]),
                   "wiki.test.raw is not UTF-8 text (byte 0): the file is damaged")
    # parses, but not what the tasks read (tracebacks deep in jinja2 / datasets before)
    for text, says in (('{"x": "hello world"}\n', "line 1 has no \"text\" string (it has 'x')"),
                       ('{"text": 5}\n', "line 1 has no \"text\" string"), ("\n", "holds no record")):
        (bad / "lambada" / "lambada_test.jsonl").write_text(text)
        one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "lambada_local", "--data-dir", str(bad)]),
                       says)
    (bad / "wikitext-2" / "wiki.test.raw").write_bytes(b"")
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "wikitext2_local", "--data-dir", str(bad)]),
                   "wiki.test.raw holds no article")
    one_line_error(capsys, main(["lm-eval", str(trained), "--tasks", "lambada_local,"]),
                   "has an empty name between its commas")


def test_compare_lm_eval_column_mean_std_over_seeds(tmp_path, text_file, data_dir):
    from test_compare import tiny_recipe

    from phaseloop.compare import run_comparison

    recipe = tiny_recipe(text_file, variants=["rope", "universal"], eval_tasks=["lambada_local"],
                         eval_limit=3)
    out = tmp_path / "c"
    s = run_comparison(recipe, out, progress=False, log=None)
    for v in s["variants"]:
        acc, ppl = v["lm_eval"]["lambada_local/acc"], v["lm_eval"]["lambada_local/perplexity"]
        runs = [json.loads((out / "runs" / f"{v['slug']}-s{seed}" / "lm_eval" / "results.json").read_text())
                for seed in (0, 1)]
        per_seed = [r["results"]["lambada_local"]["perplexity,none"] for r in runs]
        assert ppl["mean"] == pytest.approx(sum(per_seed) / 2) and ppl["std"] is not None
        assert 0 <= acc["mean"] <= 1
    report = (out / "report.md").read_text()
    assert "lambada_local/perplexity" in report and "lambada_local/acc" in report
    # a run scored since with other settings (lm-eval --limit 1): scored again with the recipe's
    run = out / "runs" / "rope-s0" / "lm_eval" / "results.json"
    res = json.loads(run.read_text())
    assert res["phaseloop"] == {"tasks": ["lambada_local"], "limit": 3, "depth": None, "extend_loops": None,
                                "dtype": "float32"}
    run.write_text(json.dumps({**res, "phaseloop": {**res["phaseloop"], "limit": 1}}))
    run_comparison(recipe, out, progress=False, log=None)
    assert json.loads(run.read_text())["phaseloop"]["limit"] == 3
    with pytest.raises(Exception, match="eval_tasks"):
        tiny_recipe(text_file, eval_tasks="lambada_local")


def test_a_failed_export_leaves_no_folder_it_made(tmp_path):
    """An error (an interrupt) while an export's folder is written: neither the folder nor the
    parents it made stay (an empty `sub/` stayed); a parent that was there stays."""
    from phaseloop.hf.export import atomic_folder

    for error in (KeyboardInterrupt, OSError):
        with pytest.raises(error), atomic_folder(tmp_path / "a" / "b" / "out") as tmp:
            (tmp / "config.json").write_text("{}")
            raise error()
        assert list(tmp_path.iterdir()) == []
    with atomic_folder(tmp_path / "a" / "out") as tmp:
        (tmp / "config.json").write_text("{}")
    assert (tmp_path / "a" / "out" / "config.json").is_file()
