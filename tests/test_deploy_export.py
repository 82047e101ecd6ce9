"""The baseline as a native Llama and as GGUF (phaseloop.hf.llama, gguf, formats; issue 40):
a rope run's LlamaForCausalLM folder (no remote code) has phaseloop's logits (fp32, measured
bit-equal; asserted to 1e-6) and greedy tokens; the GGUF file read back holds every weight
(f32 exactly, f16 as fp16 rounds it, Q8_0 within half a block step) and the run's
hyperparameters and tokenizer; llama.cpp (where llama-cpp-python is installed) runs it to
phaseloop's greedy tokens; every other model or bad combination is one line, exit 2,
nothing written."""

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from conftest import assert_one_line, run_cli, snapshot, write_corpus
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from phaseloop import ModelConfig, build_model
from phaseloop.cli import main
from phaseloop.engine.checkpoint import load_run, run_tokenizer
from phaseloop.hf.gguf import gguf_tokenizer, read_gguf
from phaseloop.hf.llama import to_llama
from phaseloop.hf.llama_map import llama_tensors, refusal

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = ["--steps", "30", "--batch-size", "8", "--eval-windows", "2", "--warmup", "3", "--quiet",
         "--eval-every", "1000", "--ckpt-every", "1000", "--compile", "off"]
PROMPT = "the qu"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Trained rope-tiny runs (plain; tied with sqrt(d) embedding scale; tied; a BPE
    tokenizer) and a 3PT run."""
    root = tmp_path_factory.mktemp("deploy")
    text = write_corpus(root / "corpus.txt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert main(["tokenizer", "train", "--data", str(text), "--vocab-size", "300", "--quiet", "--out",
                 str(root / "tok")]) == 0
    out = {"root": root}
    for name, extra in (("rope", []), ("scaled", ["--set", "tie_embeddings=true", "--set", "embed_scale=true"]),
                        ("tied", ["--set", "tie_embeddings=true"]),  # exported tied: no lm_head / output.weight
                        ("bpe", ["--tokenizer", str(root / "tok" / "tokenizer.json")]),
                        ("3pt", ["--preset", "3pt-tiny", "--steps", "2"])):
        preset = [] if "--preset" in extra else ["--preset", "rope-tiny"]
        assert main(["train", *preset, *TRAIN, *extra, "--data", str(text), "--out", str(root / name)]) == 0
        out[name] = root / name
    torch.set_num_threads(threads)
    return out


def _greedy(run, capsys, n=24):
    capsys.readouterr()
    assert main(["generate", str(run), "--json", "--temperature", "0", "--max-new-tokens", str(n),
                 "--prompt", PROMPT]) == 0
    return json.loads(capsys.readouterr().out)["tokens"]


@pytest.mark.parametrize("over", [{}, {"tie_embeddings": True}, {"embed_scale": True},
                                  {"embed_scale": True, "tie_embeddings": True}, {"n_kv_heads": 6}])
def test_llama_has_phaseloops_logits_and_greedy_tokens(over):
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("rope-tiny", **over)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    llama = to_llama(model)
    x = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(x).logits, llama(x).logits
    assert (want - got).abs().max() <= 1e-6
    assert torch.equal(llama.generate(x, max_new_tokens=16, do_sample=False), model.generate(x, 16, temperature=0))


def test_the_rope_convention_and_the_split_are_checked():
    """Negative controls: k and v (or gate and up) swapped differ (the RoPE pairs' control is
    GGUF's: test_gguf_q_and_k_rows_are_interleaved_pairs)."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("rope-tiny")).eval()
    x = torch.randint(0, 256, (1, 12))
    llama = to_llama(model)
    sd = llama.state_dict()
    for a, b in (("self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        wrong = to_llama(model)
        wrong.load_state_dict({**sd, f"model.layers.0.{a}.weight": sd[f"model.layers.0.{b}.weight"],
                               f"model.layers.0.{b}.weight": sd[f"model.layers.0.{a}.weight"]})
        with torch.no_grad():
            assert (wrong(x).logits - model(x).logits).abs().max() > 1e-4


def test_export_llama_folder_loads_without_phaseloop_code(runs, tmp_path, capsys):
    for name in ("rope", "scaled", "tied", "bpe"):
        out = tmp_path / name
        assert main(["export", str(runs[name]), "--format", "llama", "--out", str(out)]) == 0
        conf = json.loads((out / "config.json").read_text())
        assert conf["model_type"] == "llama" and conf["architectures"] == ["LlamaForCausalLM"]
        assert "auto_map" not in conf and not list(out.glob("*.py"))
        llama = AutoModelForCausalLM.from_pretrained(out).eval()
        assert type(llama) is LlamaForCausalLM
        tied = llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()
        assert conf["tie_word_embeddings"] is tied is (name == "tied")  # scaled: untied (docs/deploy.md)
        tok = AutoTokenizer.from_pretrained(out)
        model, _ = load_run(runs[name])
        ids = tok(PROMPT, return_tensors="pt").input_ids
        assert ids[0].tolist() == run_tokenizer(runs[name], load_run(runs[name])[1]).encode(PROMPT).tolist()
        new = llama.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
        assert new == _greedy(runs[name], capsys)
        with torch.no_grad():
            assert (llama(ids).logits - model(ids).logits).abs().max() <= 1e-6


def test_other_models_and_bad_combinations_are_refused(runs, tmp_path, capsys):
    before = snapshot(tmp_path)
    cases = [
        (["export", runs["3pt"], "--format", "llama", "--out", tmp_path / "a"],
         "--format llama cannot take this three_phase run: only a rope run with the Llama block is a Llama; "
         "it exports as: hf"),
        (["export", runs["3pt"], "--format", "gguf", "--out", tmp_path / "a.gguf"],
         "--format gguf cannot take this three_phase run"),
        (["export", runs["rope"], "--format", "llama", "--outtype", "f16", "--out", tmp_path / "a"],
         "--outtype applies to --format gguf, not llama"),
        (["export", runs["rope"], "--format", "gguf", "--dtype", "bfloat16", "--out", tmp_path / "a.gguf"],
         "--dtype applies to --format hf / llama, not gguf"),
        (["export", runs["rope"], "--format", "gguf", "--depth", "2", "--out", tmp_path / "a.gguf"],
         "--format gguf takes a rope run, a stack of distinct layers"),
        (["export", runs["rope"], "--depth", "2", "--out", tmp_path / "a"], "has no depth to change"),
        (["export", runs["rope"], "--format", "gguf", "--out", tmp_path], "is a folder"),
        (["export", runs["rope"], "--format", "gguf", "--out", tmp_path / "a.txt"], "pass --out NAME.gguf"),
        (["export", runs["rope"], "--format", "onnx", "--out", tmp_path / "a"], "invalid choice"),
    ]
    for argv, pattern in cases:
        code, err = run_cli(argv, capsys)
        assert_one_line(code, err, pattern)
    assert snapshot(tmp_path) == before
    cfg = ModelConfig.from_preset("rope-tiny", n_phases=3, phase_rotation=True)
    assert refusal(cfg) == "n_phases=3 is an option a Llama has no equivalent for"
    assert "ffn='relu'" in refusal(ModelConfig.from_preset("rope-tiny", ffn="relu"))
    (tmp_path / "there.gguf").write_bytes(b"mine")
    code, err = run_cli(["export", runs["rope"], "--format", "gguf", "--out", tmp_path / "there.gguf"], capsys)
    assert_one_line(code, err, "exists; choose a new file")
    assert (tmp_path / "there.gguf").read_bytes() == b"mine"


def test_a_failed_gguf_write_leaves_nothing(runs, tmp_path, monkeypatch, capsys):
    import phaseloop.hf.gguf as g

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device", "x")

    monkeypatch.setattr(g.gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    for out in (tmp_path / "m.gguf", tmp_path / "a" / "b" / "m.gguf"):  # and the folders it made
        code, err = run_cli(["export", runs["rope"], "--format", "gguf", "--out", out], capsys)
        assert_one_line(code, err, f"{out}: No space left on device")
        assert list(tmp_path.iterdir()) == []


def test_a_file_that_appears_during_the_export_is_left_alone(runs, tmp_path, monkeypatch, capsys):
    """The name was free when the export began; a file put there while it wrote (minutes
    for a .pte) is neither overwritten nor removed."""
    import phaseloop.hf.gguf as g

    write = g.write_gguf
    out = tmp_path / "m.gguf"

    def meanwhile(*a, **k):
        write(*a, **k)
        out.write_bytes(b"mine")

    monkeypatch.setattr(g, "write_gguf", meanwhile)
    code, err = run_cli(["export", runs["rope"], "--format", "gguf", "--out", out], capsys)
    assert_one_line(code, err, "appeared while it was being written")
    assert out.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


@pytest.fixture(scope="module")
def ggufs(runs, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for name in ("rope", "scaled", "tied", "bpe"):
        for outtype in ("f32", "f16", "q8_0"):
            path = root / f"{name}-{outtype}.gguf"
            assert main(["export", str(runs[name]), "--format", "gguf", "--outtype", outtype, "--out", str(path)]) == 0
            out[name, outtype] = path
    return out


@pytest.mark.parametrize("name", ["rope", "scaled", "tied", "bpe"])
@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_gguf_holds_the_run(runs, ggufs, name, outtype):
    model, run_cfg = load_run(runs[name])
    meta, tensors = read_gguf(ggufs[name, outtype])
    cfg = model.cfg
    assert meta["general.architecture"] == "llama"
    want_meta = {"llama.block_count": cfg.n_layers, "llama.embedding_length": cfg.d_model,
                 "llama.feed_forward_length": cfg.d_ff, "llama.attention.head_count": cfg.n_heads,
                 "llama.attention.head_count_kv": cfg.n_kv_heads, "llama.rope.dimension_count": cfg.head_dim,
                 "llama.context_length": cfg.max_seq_len, "llama.vocab_size": cfg.vocab_size}
    assert {k: meta[k] for k in want_meta} == want_meta
    assert math.isclose(meta["llama.rope.freq_base"], cfg.rope_base, rel_tol=1e-7)
    assert math.isclose(meta["llama.attention.layer_norm_rms_epsilon"], cfg.norm_eps, rel_tol=1e-6)
    tok = gguf_tokenizer(run_tokenizer(runs[name], run_cfg), cfg.vocab_size)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.tokens"] == tok["tokens"]
    assert meta["tokenizer.ggml.merges"] == tok["merges"] and len(tok["tokens"]) == cfg.vocab_size
    want = llama_tensors(model)
    assert set(tensors) == set(want)
    for key, w in want.items():
        got, kind = tensors[key]
        w = w.numpy()
        assert got.shape == w.shape, key
        if w.ndim == 1 or outtype == "f32":
            assert kind == "F32" and np.array_equal(got, w), key
        elif outtype == "f16":
            assert kind == "F16" and np.array_equal(got, w.astype(np.float16).astype(np.float32)), key
        else:  # Q8_0: per block of 32, an fp16 scale d = max|w| / 127 and round(w / d)
            assert kind == "Q8_0", key
            blocks = w.reshape(-1, 32)
            d = (np.abs(blocks).max(1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
            err = np.abs(got.reshape(-1, 32) - blocks)
            assert (err <= d * 0.5 + np.abs(blocks) * 2e-3 + 1e-12).all(), key
            assert err.max() > 0  # really quantised
    if name == "bpe":
        spec = json.loads((runs["bpe"] / "tokenizer.json").read_text())
        assert len(meta["tokenizer.ggml.merges"]) == len(spec["model"]["merges"]) > 0


def _rope_pairs(x_HE, pos, base, interleaved):
    """RoPE at ``pos`` of [H, E] rows: rotate-half (phaseloop, Llama) pairs i, i + E/2;
    interleaved (GGML's, llama.cpp's LLaMA graph) pairs 2i, 2i + 1; angle pos base^(-2i/E)."""
    H, E = x_HE.shape
    ang = pos * base ** (-np.arange(0, E, 2) / E)
    c, s = np.cos(ang), np.sin(ang)
    a, b = (x_HE[:, 0::2], x_HE[:, 1::2]) if interleaved else (x_HE[:, :E // 2], x_HE[:, E // 2:])
    ra, rb = a * c - b * s, a * s + b * c
    return np.stack([ra, rb], -1).reshape(H, E) if interleaved else np.concatenate([ra, rb], 1)


def test_gguf_q_and_k_rows_are_interleaved_pairs(runs, ggufs):
    """The q/k rows as the file stores them (not read back through ``unpermute``), under
    GGML's interleaved RoPE, give the attention scores phaseloop's rotate-half RoPE gives
    with its own weights, head by head (GQA included); the unpermuted rows do not. Checked
    without llama.cpp, so CI catches a permutation in the wrong direction or none."""
    import gguf

    model, _ = load_run(runs["rope"])
    cfg, hf = model.cfg, {k: v.double().numpy() for k, v in llama_tensors(model).items()}
    stored = {t.name: np.asarray(t.data, dtype=np.float64).reshape(t.data.shape)
              for t in gguf.GGUFReader(str(ggufs["rope", "f32"])).tensors}
    x_D, y_D = np.random.default_rng(0).standard_normal((2, cfg.d_model))
    per = cfg.n_heads // cfg.n_kv_heads

    def scores(wq, wk, interleaved):
        q = _rope_pairs((wq @ x_D).reshape(cfg.n_heads, -1), 9, cfg.rope_base, interleaved)
        k = _rope_pairs((wk @ y_D).reshape(cfg.n_kv_heads, -1), 4, cfg.rope_base, interleaved)
        return np.array([q[h] @ k[h // per] for h in range(cfg.n_heads)])

    for i in range(cfg.n_layers):
        want = scores(hf[f"model.layers.{i}.self_attn.q_proj.weight"], hf[f"model.layers.{i}.self_attn.k_proj.weight"],
                      interleaved=False)
        got = scores(stored[f"blk.{i}.attn_q.weight"], stored[f"blk.{i}.attn_k.weight"], interleaved=True)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        unpermuted = scores(hf[f"model.layers.{i}.self_attn.q_proj.weight"],
                            hf[f"model.layers.{i}.self_attn.k_proj.weight"], interleaved=True)
        assert np.abs(unpermuted - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (CI does not build it: 10-40 minutes); "
                    "benchmarks/bench_deploy.py runs this check where it is")
@pytest.mark.parametrize("name", ["rope", "scaled", "tied", "bpe"])
def test_llama_cpp_runs_the_gguf_to_phaseloops_greedy_tokens(runs, ggufs, name, capsys, monkeypatch, tmp_path):
    from llama_cpp import Llama

    model, run_cfg = load_run(runs[name])
    tok = run_tokenizer(runs[name], run_cfg)
    ids = tok.encode(PROMPT).tolist()
    want = _greedy(runs[name], capsys)
    for outtype in ("f32", "f16"):
        llm = Llama(model_path=str(ggufs[name, outtype]), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
        try:
            assert llm.tokenize(PROMPT.encode(), add_bos=False, special=False) == ids
            got = []
            for t in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                got.append(int(t))
                if len(got) == len(want):
                    break
            assert got == want, outtype
            llm.reset()
            llm.eval(ids)
            with torch.no_grad():
                ref = model(torch.tensor([ids])).logits[0].numpy()
            err = np.abs(np.array(llm.scores[:len(ids)]) - ref).max()
            assert err <= (2e-3 if outtype == "f32" else 1e-2) * max(1.0, np.abs(ref).max()), err
        finally:
            llm.close()
    if name == "rope":  # negative control: q/k rows left in rotate-half order
        import phaseloop.hf.gguf as g
        monkeypatch.setattr(g, "permute", lambda w, n_head: w)
        g.write_gguf(model, tok, tmp_path / "noperm.gguf")
        llm = Llama(model_path=str(tmp_path / "noperm.gguf"), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
        try:
            llm.eval(ids)
            assert np.abs(np.array(llm.scores[:len(ids)]) - ref).max() > 50 * err
        finally:
            llm.close()


def test_gguf_eos_is_an_id_no_text_maps_to():
    """llama.cpp stops at the file's EOS id: the first padding id past the tokenizer's
    (256 of 260 for the byte tokenizer), not a byte a text can hold (255 would stop at 0xFF)."""
    import gguf

    from phaseloop.data.tokenizer import ByteTokenizer

    t = gguf_tokenizer(ByteTokenizer(), 260)
    assert t["eos"] == 256 and t["tokens"][256] == "[PAD256]" and t["types"][256] == gguf.TokenType.UNUSED
    assert all(ty == gguf.TokenType.NORMAL for ty in t["types"][:256])
