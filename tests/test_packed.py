"""Packed low-bit weights (phaseloop.quant.packed / load, issue 40): a PackedLinear computes
the dequantised weight's product (exactly with fp32 activations, at bf16's resolution with
the fast bf16 path), a packed run's loss equals the dequantised reference within 1e-3
relative, int4 g32 weights take <= 0.2x their fp32 bytes, and a damaged, foreign or
mismatched quantised file is refused by name (one line, exit 2)."""

import json
import shutil

import pytest
import torch
from conftest import assert_one_line, run_cli, write_corpus

from phaseloop.cli import main
from phaseloop.engine.checkpoint import load_run, run_corpus, save_checkpoint
from phaseloop.errors import PhaseloopError
from phaseloop.inference import decode_layout, onednn_linear, prepacked_bytes
from phaseloop.lm.train import eval_set, evaluate
from phaseloop.quant import PackedLinear, QuantizedWeight, load_dequantized, load_packed, quantize_rtn, weight_bytes
from phaseloop.quant.core import dequantize
from phaseloop.quant.io import DIGEST, HEADER, header_digest, tensors_digest

pytestmark = pytest.mark.usefixtures("one_thread")

TRAIN = ["--preset", "rope-tiny", "--steps", "30", "--batch-size", "8", "--eval-windows", "2", "--warmup", "3",
         "--quiet", "--eval-every", "1000", "--ckpt-every", "1000", "--compile", "off"]


def _qw(N, K, bits, group, sym=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) * torch.linspace(0.2, 2.0, N)[:, None] + 0.3
    q, s, z = quantize_rtn(W, bits, group, sym=sym)
    return QuantizedWeight.from_codes(q, s, z, bits, sym=sym), dequantize(q, s, z)


# (N, K, bits, group): per group, per row (kernel group < row), a group the int4 kernel
# takes as repeats (96 = 3 x 32), a row no kernel group divides (padded to 192), int8
# stacked groups, an N the int4 kernel refuses, int8 rows of a length not a multiple of 16
# (3PT's d_model 120; padded: the kernel's bf16 path crashed on them)
SHAPES = [(64, 128, 4, 32), (64, 96, 4, -1), (48, 192, 4, 96), (32, 176, 4, -1), (64, 128, 8, 32),
          (64, 96, 8, -1), (40, 64, 4, 32), (32, 64, 8, 64), (64, 72, 8, -1), (64, 120, 8, 40), (48, 200, 8, -1)]


@pytest.mark.parametrize("N,K,bits,group", SHAPES)
@pytest.mark.parametrize("sym", [False, True])
def test_packed_linear_is_the_dequantised_weight(N, K, bits, group, sym):
    qw, W = _qw(N, K, bits, None if group == -1 else group, sym)
    bias = torch.randn(N)
    x = torch.randn(3, 5, K)
    want = x @ W.t() + bias
    exact = PackedLinear(qw, bias, act_dtype=torch.float32)  # the kernels' fp32 path: the weight mapping alone
    assert exact.kernel == ("fp32" if N % 16 else f"int{bits}")
    assert (exact(x) - want).abs().max() <= 1e-5 * want.abs().max()
    fast = PackedLinear(qw, bias)  # bf16 activations and scales, as it runs
    assert fast(x).dtype == torch.float32 and fast(x).shape == want.shape
    err = (fast(x) - want).abs().max() / want.abs().max()
    assert err <= 1e-2, err  # bf16 (8 bits of mantissa) of activations, scales and outputs
    wrong = QuantizedWeight(qw.qdata, qw.scale, qw.zero + 1, bits, qw.group_size, qw.shape)
    off = PackedLinear(wrong, bias, act_dtype=torch.float32)(x)
    assert (off - want).abs().max() > 100 * 1e-5 * want.abs().max()  # a zero off by one step shows


def test_packed_module_keeps_its_buffers_through_to_and_double():
    qw, W = _qw(64, 128, 4, 32)
    m = PackedLinear(qw).double()
    assert m.scale_zero.dtype == torch.bfloat16 and m.codes.dtype == torch.uint8
    x = torch.randn(2, 128, dtype=torch.float64)
    assert m(x).dtype == torch.float64
    assert (m(x) - x @ W.double().t()).abs().max() <= 1e-2 * (x @ W.double().t()).abs().max()


@pytest.mark.parametrize("n,k,bits,g", [(64, 128, 4, 32), (64, 128, 8, 32), (24, 128, 4, 16)])  # last: fp32
def test_packed_buffers_survive_a_round_trip_through_other_dtypes(n, k, bits, g):
    """``.to(bf16)`` / ``.half()`` then ``.float()`` leave every buffer bit for bit (an fp32
    offset or fallback weight sent through bf16 was rounded: 2e-3 of the output)."""
    qw, _ = _qw(n, k, bits, g)
    m = PackedLinear(qw)
    before = {name: b.clone() for name, b in m.named_buffers()}
    x = torch.randn(3, k)
    y = m(x)
    m.to(torch.bfloat16).float()
    m.half().float()
    assert all(torch.equal(before[name], b) and before[name].dtype == b.dtype for name, b in m.named_buffers())
    assert torch.equal(m(x), y)


def test_weight_bytes_int4_g32_at_most_a_fifth_of_fp32():
    """int4 codes (half a byte) + bf16 scale and zero per 32 weights: 0.156 of fp32."""
    qw, _ = _qw(256, 512, 4, 32)
    lin = torch.nn.Sequential(PackedLinear(qw))
    now, fp32 = weight_bytes(lin)
    assert fp32 == 4 * 256 * 512
    assert now == 256 * 512 // 2 + 256 * 512 // 32 * 2 * 2
    assert now / fp32 <= 0.2
    tied = torch.nn.Linear(4, 4)
    both = torch.nn.ModuleList([tied, tied])
    assert weight_bytes(both) == (4 * 20, 4 * 20)  # one module twice: counted once


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A trained rope-tiny run, a second one of the same shapes (another seed) and a
    Hyperloop run (a weight-shared block), with their quantised files."""
    root = tmp_path_factory.mktemp("packed")
    text = write_corpus(root / "corpus.txt")
    out = {"root": root, "text": text}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second thread only waits
    for name, extra in (("run", []), ("other", ["--seed", "1", "--steps", "2"]),
                        ("loop", ["--preset", "hyperloop-tiny", "--steps", "12"]),
                        ("tied", ["--steps", "2", "--set", "tie_embeddings=true"])):
        assert main(["train", *TRAIN, *extra, "--data", str(text), "--out", str(root / name)]) == 0
        out[name] = root / name
    for bits, group in ((4, 32), (8, 32), (8, -1)):
        assert main(["quantize", str(out["run"]), "--bits", str(bits), "--group-size", str(group),
                     "--windows", "2"]) == 0
    assert main(["quantize", str(out["run"]), "--bits", "4", "--group-size", "32", "--head", "--windows", "2"]) == 0
    assert main(["quantize", str(out["other"]), "--bits", "4", "--group-size", "32", "--windows", "2"]) == 0
    assert main(["quantize", str(out["loop"]), "--bits", "4", "--group-size", "32", "--method", "gptq",
                 "--windows", "2", "--calib-batches", "2", "--calib-batch-size", "2"]) == 0
    torch.set_num_threads(threads)
    return out


def _loss(model, run, run_cfg, windows=16):
    corpus = run_corpus(run, run_cfg)
    _, val = corpus.split(0.1, model.cfg.max_seq_len + 1)
    w, docs = eval_set(corpus, val, model.cfg.max_seq_len, windows, run_cfg["train"])
    return evaluate(model, w, corpus.tokenizer, 16, "cpu", None, docs)["val_loss"]


@pytest.mark.parametrize("name,file", [("run", "quant-w4-g32-rtn"), ("run", "quant-w4-g32-rtn-head"),
                                       ("run", "quant-w8-g32-rtn"),
                                       ("run", "quant-w8-g-1-rtn"), ("loop", "quant-w4-g32-gptq")])
def test_packed_loss_equals_the_dequantised_reference(world, name, file):
    run = world[name]
    qfile = run / f"{file}.safetensors"
    ref, run_cfg = load_run(run)
    load_dequantized(ref, qfile, run, run_cfg)
    packed, _, info = load_packed(run, qfile)
    assert set(info["kernels"].values()) == {"int" + file[7]}
    assert ("head" in info["kernels"]) == file.endswith("-head")
    assert not [n for n, m in packed.named_modules() if isinstance(m, torch.nn.Linear) and n in info["kernels"]]
    want, got = _loss(ref, run, run_cfg), _loss(packed, run, run_cfg)
    assert abs(got - want) <= 1e-3 * want, (got, want)
    if file.startswith("quant-w4"):  # int4's error is far above bf16's: the quantised weights, not the originals
        plain, _ = load_run(run)
        factor = 2 if file.endswith("-head") else 10  # bf16 activations into the head: logits move more
        assert abs(_loss(plain, run, run_cfg) - want) > factor * abs(got - want)


def test_eval_and_generate_take_quantized(world, capsys):
    run, qfile = world["run"], world["run"] / "quant-w4-g32-rtn.safetensors"
    res = json.loads(_out(capsys, ["eval", run, "--quantized", qfile, "--json", "--windows", "4"]))
    ref, run_cfg = load_run(run)
    load_dequantized(ref, qfile, run, run_cfg)
    want = json.loads(_out(capsys, ["eval", run, "--json", "--windows", "4"]))["val_loss"]
    assert res["quantized"] == str(qfile) and res["val_loss"] != want
    gen = json.loads(_out(capsys, ["generate", run, "--quantized", qfile, "--json", "--max-new-tokens", "8",
                                   "--temperature", "0", "--prompt", "the"]))
    packed, _, _ = load_packed(run, qfile)
    decode_layout(packed)  # as generate lays it out: the fp32 head's oneDNN copy counted
    assert (gen["weight_bytes"], gen["weight_bytes_fp32"]) == weight_bytes(packed)
    plain = json.loads(_out(capsys, ["generate", run, "--json", "--max-new-tokens", "8", "--prompt", "the"]))
    dense = sum(4 * m.weight.numel() for m in ref.modules() if type(m) is torch.nn.Linear)
    assert plain["weight_bytes"] == plain["weight_bytes_fp32"] + dense * onednn_linear()
    assert plain["weight_bytes_fp32"] == gen["weight_bytes_fp32"]
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    q_now = sum(t.untyped_storage().nbytes() for m in layers for t in m.weight_tensors())
    q_fp32 = sum(4 * m.in_features * m.out_features for m in layers)
    assert q_now <= 0.2 * q_fp32
    assert gen["weight_bytes"] == gen["weight_bytes_fp32"] - q_fp32 + q_now + prepacked_bytes(packed)
    assert len(gen["tokens"]) == 8 and gen["prompt"].startswith("the") and len(gen["text"]) > 0
    assert gen["tokens_per_s"] > 0


def test_a_state_dict_error_names_its_key():
    """load_state_dict's first line names nothing ("Error(s) in loading state_dict for ..."):
    a quant file that does not fit says which entry instead."""
    from phaseloop.errors import state_dict_error

    m = torch.nn.Linear(3, 4)
    with pytest.raises(RuntimeError) as e:
        m.load_state_dict({"weight": torch.zeros(2, 3), "bias": torch.zeros(4)})
    assert state_dict_error(e.value).startswith("size mismatch for weight: copying a param with shape")
    with pytest.raises(RuntimeError) as e:
        m.load_state_dict({"weight": torch.zeros(4, 3)})
    assert state_dict_error(e.value) == 'Missing key(s) in state_dict: "bias".'
    assert state_dict_error(RuntimeError("one\ntwo")) == "one"


def test_auto_device_with_quantized_is_the_cpu(world, capsys, monkeypatch):
    """On a machine with a GPU, --device auto (the default) was cuda, which the packed CPU
    kernels refuse: the docs' own `eval RUN --quantized FILE` exited 2 there."""
    run, qfile = world["run"], world["run"] / "quant-w4-g32-rtn.safetensors"
    want = json.loads(_out(capsys, ["eval", run, "--quantized", qfile, "--json", "--windows", "2"]))["val_loss"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    got = json.loads(_out(capsys, ["eval", run, "--quantized", qfile, "--json", "--windows", "2"]))["val_loss"]
    assert got == want
    code, err = run_cli(["eval", run, "--quantized", qfile, "--windows", "2", "--device", "cuda"], capsys)
    assert_one_line(code, err, "use --device cpu")


def test_quantize_head_packs_the_head_and_refuses_a_tied_one(world, capsys):
    """--head: the output head packed as well (the embedding stays fp32), in its own file; a
    head tied to the embedding is refused in one line and nothing is written."""
    run = world["run"]
    body, _, _ = load_packed(run, run / "quant-w4-g32-rtn.safetensors")
    both, _, info = load_packed(run, run / "quant-w4-g32-rtn-head.safetensors")
    assert isinstance(both.head, PackedLinear) and not isinstance(body.head, PackedLinear)
    assert both.embed.tok.weight.dtype == torch.float32 and info["kernels"]["head"] == "int4"
    head_fp32 = 4 * both.head.in_features * both.head.out_features
    saved = weight_bytes(body)[0] - weight_bytes(both)[0]
    assert 0.8 * head_fp32 <= saved < head_fp32  # the head at <= 0.2x its fp32 bytes
    report = json.loads((run / "quant-w4-g32-rtn-head.json").read_text())
    assert report["head"] is True and "head" in report["layers"]
    tied = world["tied"]
    before = sorted(p.name for p in tied.iterdir())
    code, err = run_cli(["quantize", tied, "--bits", "4", "--head", "--windows", "2"], capsys)
    assert_one_line(code, err, "head is tied to its embedding")
    assert sorted(p.name for p in tied.iterdir()) == before


def _out(capsys, argv):
    assert main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def test_foreign_damaged_and_mismatched_files_are_refused_by_name(world, tmp_path, capsys):
    run, qfile = world["run"], world["run"] / "quant-w4-g32-rtn.safetensors"
    cases = [
        (world["other"] / "quant-w4-g32-rtn.safetensors", "was quantised from another checkpoint"),
        (world["loop"] / "quant-w4-g32-gptq.safetensors", "was quantised from another model"),
        (run / "checkpoint" / "model.safetensors", "is not a phaseloop quantised file"),
        (tmp_path / "nope.safetensors", "no such file"),
        (tmp_path, "is a folder"),
    ]
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(qfile.read_bytes()[: qfile.stat().st_size // 2])
    cases.append((cut, "is damaged"))
    noise = tmp_path / "noise.safetensors"
    noise.write_bytes(b"\x07" * 64)
    cases.append((noise, "is damaged"))
    for path, pattern in cases:
        for cmd in (["eval", run, "--windows", "2"], ["generate", run, "--max-new-tokens", "2"]):
            code, err = run_cli([*cmd, "--quantized", path], capsys)
            assert_one_line(code, err, pattern)
            assert str(path) in err
    code, err = run_cli(["export", run, "--out", tmp_path / "x", "--quantized", cases[0][0]], capsys)
    assert_one_line(code, err, "another checkpoint")
    assert not (tmp_path / "x").exists()


def _edited(src, dst, meta=lambda m: m, tensors=lambda t: t, redigest: bool = True):
    """``src`` rewritten at ``dst`` with its header and tensors edited, its tensors' and its
    header's digests written again (an edit that keeps the file whole: the checks behind the
    digests see it; ``redigest`` False: the header's digest kept, as an editor would)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), "pt") as f:
        m, t = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    t = tensors(t)
    m = meta({**m, DIGEST: tensors_digest(t)} if DIGEST in m else m)
    if redigest and HEADER in m:
        m[HEADER] = header_digest(m)
    save_file(t, str(dst), metadata=m)
    return dst


def test_edited_headers_and_damaged_values_are_refused(world, tmp_path, capsys):
    """A file without the keys that tie it to a run (or an fp32 checkpoint given the quant
    format) is not taken for this run's; a non-finite scale or a malformed layout entry is
    refused by name, whichever command reads it."""
    run, qfile = world["run"], world["run"] / "quant-w4-g32-rtn.safetensors"
    from safetensors import safe_open

    with safe_open(str(qfile), "pt") as f:
        layer = next(k for k in f.keys() if k.endswith(".scale"))
    prefix = layer[: -len(".scale")]
    fmt = {"format": "phaseloop.quant.v1"}
    cases = [
        (_edited(qfile, tmp_path / "noprov.safetensors",
                 meta=lambda m: {k: v for k, v in m.items() if k != "model_config_sha256"}),
         "holds no model_config_sha256"),
        (_edited(world["other"] / "checkpoint" / "model.safetensors", tmp_path / "fake.safetensors",
                 meta=lambda m: {**m, **fmt}), "holds no model_config_sha256"),
        (_edited(qfile, tmp_path / "nan.safetensors",
                 tensors=lambda t: {**t, layer: t[layer].clone().fill_(float("nan"))}), "not finite"),
        (_edited(qfile, tmp_path / "zero.safetensors",
                 tensors=lambda t: {**t, layer: torch.zeros_like(t[layer])}), "not positive"),
        (_edited(qfile, tmp_path / "qmeta.safetensors",
                 tensors=lambda t: {**t, prefix + ".qmeta": torch.zeros(2, 3, dtype=torch.int64)}), "qmeta"),
    ]
    norm = "norm.weight"  # a plain entry: a NaN there was taken as it was (the export wrote it)
    cases.append((_edited(qfile, tmp_path / "nannorm.safetensors",
                          tensors=lambda t: {**t, norm: t[norm].clone().fill_(float("nan"))}),
                  "norm.weight is not finite"))
    for path, pattern in cases:
        for cmd in (["eval", run, "--windows", "2"], ["export", run, "--out", tmp_path / "x"]):
            code, err = run_cli([*cmd, "--quantized", path], capsys)
            assert_one_line(code, err, pattern)
            assert str(path) in err and not (tmp_path / "x").exists()
    # this run's file with the other run's checkpoint digest written into its header (the same
    # config): it loaded into the other run, this run's embedding, norms and head included
    with safe_open(str(world["other"] / qfile.name), "pt") as f:
        theirs = {k: f.metadata()[k] for k in ("run", "checkpoint_sha256")}
    moved = _edited(qfile, tmp_path / "moved.safetensors", redigest=False, meta=lambda m: {**m, **theirs})
    code, err = run_cli(["eval", world["other"], "--windows", "2", "--quantized", moved], capsys)
    assert_one_line(code, err, "is damaged or was edited: its metadata")
    # the same with the header's digest deleted too: there was nothing to check, and it loaded
    stripped = _edited(qfile, tmp_path / "stripped.safetensors", redigest=False,
                       meta=lambda m: {**{k: v for k, v in m.items() if k != HEADER}, **theirs})
    code, err = run_cli(["eval", world["other"], "--windows", "2", "--quantized", stripped], capsys)
    assert_one_line(code, err, "holds no header_sha256")
    # run packed (eval), a plain entry in another dtype and a bias the layer does not have (nor the file
    # a bias it has) were taken as they were: an fp16 embedding failed in the forward, the bias was added
    linear = prefix[: -len(".weight")]  # a quantised Linear without a bias (bias=False, the default)
    packed_cases = [
        (_edited(qfile, tmp_path / "half.safetensors", tensors=lambda t: {**t, norm: t[norm].half()}),
         "norm.weight is torch.float16, the model's is torch.float32"),
        (_edited(qfile, tmp_path / "bias.safetensors",
                 tensors=lambda t: {**t, linear + ".bias": torch.zeros(3)}),
         f"holds a bias [3] for {linear}, whose bias is none"),
    ]
    for path, pattern in packed_cases:
        code, err = run_cli(["eval", run, "--windows", "2", "--quantized", path], capsys)
        assert_one_line(code, err, pattern)


def test_a_changed_byte_and_a_missing_digest_are_refused(world, tmp_path, capsys):
    """One code byte changed in the file's data (any value is a valid code, so no other check
    can see it; before the digest it ran as it was) and a file without the digest."""
    from phaseloop.quant import load_quantized_state_dict

    run, qfile = world["run"], world["run"] / "quant-w4-g32-rtn.safetensors"
    raw = bytearray(qfile.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    key = next(k for k in header if k.endswith(".qdata"))
    at = 8 + n + header[key]["data_offsets"][0]
    raw[at] ^= 0x11
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(bytes(raw))
    nodigest = _edited(qfile, tmp_path / "nodigest.safetensors",
                       meta=lambda m: {k: v for k, v in m.items() if k != DIGEST})
    for path, pattern in ((flipped, "is damaged: its tensors differ from the tensors_sha256"),
                          (nodigest, "holds no tensors_sha256")):
        for cmd in (["eval", run, "--windows", "2"], ["generate", run, "--max-new-tokens", "2"],
                    ["export", run, "--out", tmp_path / "x"]):
            code, err = run_cli([*cmd, "--quantized", path], capsys)
            assert_one_line(code, err, pattern)
            assert str(path) in err and not (tmp_path / "x").exists()
    with pytest.raises(PhaseloopError, match="is damaged: its tensors differ"):
        load_quantized_state_dict(flipped)
    assert set(load_quantized_state_dict(qfile)) == set(load_quantized_state_dict(nodigest))


def test_a_file_of_this_run_before_it_trained_further_is_refused(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    qfile = run / "quant-w4-g32-rtn.safetensors"
    model, run_cfg = load_run(run)
    with torch.no_grad():  # what training on writes: a later checkpoint of the same run
        model.norm.weight.add_(0.01)
    save_checkpoint(run, model, step=31, config=json.loads((run / "config.json").read_text()))
    assert load_run(run)[0].norm.weight[0] == model.norm.weight[0]
    code, err = run_cli(["eval", run, "--quantized", qfile, "--windows", "2"], capsys)
    assert_one_line(code, err, "this run before it trained further")


def test_the_hf_model_runs_packed(world, tmp_path):
    pytest.importorskip("transformers")
    from phaseloop.hf.export import from_run

    run, qfile = world["run"], world["run"] / "quant-w4-g32-rtn.safetensors"
    hf, fast, _, _ = from_run(run, quantized=qfile)
    assert hf.config.phaseloop_quantization["packed"]["trunk.layers.0.attn.q_proj"] == "int4"
    assert isinstance(hf.model.trunk.layers[0].ffn.down, PackedLinear)
    packed, _, _ = load_packed(run, qfile)
    ids = fast("the quick", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, packed(ids).logits)
    assert torch.equal(hf.generate(ids, max_new_tokens=8, do_sample=False), packed.generate(ids, 8, temperature=0))
    with pytest.raises(PhaseloopError, match="drop --dtype"):
        from_run(run, dtype="bfloat16", quantized=qfile)
    # saved, the codes would reload as random layers: refused, nothing written (export --quantized saves)
    with pytest.raises(PhaseloopError, match="save_pretrained on packed --quantized weights .* export RUN --quantized"):
        hf.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


@pytest.mark.parametrize("at", [0, 1])  # the weights' rename, the report's
def test_an_interrupted_quantize_leaves_nothing(world, tmp_path, monkeypatch, at):
    """An interrupt as the files come in: no report without its weights (one was left beside
    no weights, or beside an older file's) and no --out folder it made; a file there before stays."""
    import os

    from phaseloop.quant import run as qrun

    out = tmp_path / "made" / "q"
    real, calls = os.replace, []

    def replace(src, dst):
        if str(src).endswith((".quant-w8-g32-rtn.safetensors.tmp", ".quant-w8-g32-rtn.json.tmp")):
            calls.append(dst)  # quantize's own renames (write_json renames its own temporary file too)
            if len(calls) == at + 1:
                raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(qrun.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        qrun.quantize_run(world["run"], 8, 32, windows=2, out=out)
    if at == 0:
        assert not (tmp_path / "made").exists()
    else:  # the weights came in: they stay, the report's temporary file does not
        assert sorted(p.name for p in out.iterdir()) == ["quant-w8-g32-rtn.safetensors"]
        # again over a finished pair: the older report never stays beside the new weights
        calls.clear()
        monkeypatch.setattr(qrun.os, "replace", real)
        qrun.quantize_run(world["run"], 8, 32, windows=2, out=out)
        monkeypatch.setattr(qrun.os, "replace", replace)
        with pytest.raises(KeyboardInterrupt):
            qrun.quantize_run(world["run"], 8, 32, windows=3, out=out)
        assert sorted(p.name for p in out.iterdir()) == ["quant-w8-g32-rtn.safetensors"]
