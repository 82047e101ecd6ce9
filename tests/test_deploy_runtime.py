"""ExecuTorch's runtime runs what `phaseloop export --format executorch` makes, equal to
phaseloop: for every architecture (and the example plugin) a prefill of 8 tokens and 16
cached decode steps through ExecuTorch's Python runtime give phaseloop's logits within
1e-4 (fp32; phaseloop run the ordinary way, with its KVCache). The CLI's own files (XNNPACK)
of a trained baseline run: fp32 equal to phaseloop to 1e-4, its metadata as the record says,
ExecuTorch's C++ TextLLMRunner (reading the metadata and the tokenizer beside the file)
generating phaseloop's greedy text, and the int4 file computing its dequantised reference
within part 1's loss tolerance (1e-3 relative), its quantised layers in at most 0.2x their
fp32 bytes, measured from the two files. UT + ACT's step methods, run from the host, stop
each token where it halts, equal to the program's forward and to phaseloop, steps included.

Export is the slow part (seconds per node of the graph on a loaded 2-core machine), so the
models are each architecture's smallest with what is new about it: one layer, two steps or
passes. They are lowered to ExecuTorch's portable kernels; the CLI's XNNPACK lowering is
tested on the baseline, fp32 and int4 (benchmarks/bench_deploy.py exports every
architecture with XNNPACK at fp32 / int8 / int4 and prints the same equalities).
"""

import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch
from conftest import REPO, assert_one_line, run_cli, write_corpus

if not os.environ.get("CI"):  # CI installs the deploy extra: a missing one fails there
    pytest.importorskip("executorch")

from phaseloop import ConfigError, ModelConfig, PhaseloopError, build_model, registry
from phaseloop.data.tokenizer import ByteTokenizer
from phaseloop.deploy import pte, record_digest
from phaseloop.deploy.generate import Exported
from phaseloop.deploy.generate import generate as pte_generate
from phaseloop.deploy.program import metadata, prepare
from phaseloop.deploy.run import sidecars, tokenizer_json
from phaseloop.deploy.runtime import PteModel
from phaseloop.engine.checkpoint import load_run
from phaseloop.inference import Options
from phaseloop.inference import generate as eager_generate
from phaseloop.kvcache import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-4  # fp32 logits, prefill + 16 decode steps
# arch -> (preset, overrides, depth at export)
CASES = {
    "three_phase": ("3pt-tiny", dict(n_layers=1), None),
    "universal": ("universal-tiny", dict(n_steps=2), None),
    "universal+act": ("universal-act-tiny", dict(n_steps=1, act_max_steps=2), None),  # halts at 1 or 2
    "looped": ("looped-tiny", dict(n_layers=1, n_begin=0, n_end=0, n_loops=1), 2),  # a pass past training
    "hyperloop": ("hyperloop-tiny", dict(n_layers=1, n_begin=0, n_end=0, n_loops=2), None),
    "mhc": ("mhc-tiny", dict(n_layers=1, sinkhorn_iters=1), None),
    "parallel": (None, dict(d_model=96, n_heads=6, n_kv_heads=3, d_ff=256, n_layers=1), None),  # the
    # example plugin (examples/phaseloop-parallel); the baseline (rope): the CLI's files, below
}
PLUGIN = REPO / "examples" / "phaseloop-parallel" / "phaseloop_parallel.py"


@pytest.fixture
def plugin(monkeypatch):
    """The example plugin registered for this test only (the registry is restored after)."""
    monkeypatch.setattr(registry, "ARCHS", dict(registry.ARCHS))
    monkeypatch.setattr(registry, "PRESETS", dict(registry.PRESETS))
    spec = importlib.util.spec_from_file_location("phaseloop_parallel_example", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)


def _model(case: str):
    preset, over, _ = CASES[case]
    cfg = (ModelConfig.from_preset(preset, max_seq_len=32, **over) if preset
           else ModelConfig(arch=case, vocab_size=256, max_seq_len=32, **over))
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # off its init: a zero-init path would hide a wrong read
            p.add_(torch.randn_like(p) * 0.05)
        if getattr(model.trunk, "halting", None) is not None:  # positions halting at different steps
            model.trunk.halting.weight.normal_(0, 1.0)
            model.head.weight[128:] = 0  # greedy text in ASCII: ExecuTorch's runner hands out str pieces
    return model


def _phaseloop_logits(model, x, prompt=8):
    """prefill + one token at a time, with phaseloop's own KVCache."""
    cache = KVCache()
    with torch.no_grad():
        return torch.cat([model(x[:, :prompt], cache=cache).logits,
                          *(model(x[:, t:t + 1], cache=cache).logits for t in range(prompt, x.shape[1]))], 1)


def _runtime_logits(program, x, prompt=8):
    return torch.cat([program(x[:, :prompt], 0), *(program(x[:, t:t + 1], t) for t in range(prompt, x.shape[1]))], 1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """case -> (phaseloop model at its export depth, .pte path), exported on first use."""
    root, done = tmp_path_factory.mktemp("pte"), {}

    def get(case):
        if case not in done:
            model = _model(case)
            program = prepare(model, depth=CASES[case][2])
            path = root / f"{case}.pte"
            path.write_bytes(pte.lower(program, metadata(program), backend="portable"))
            done[case] = (model, path)
        return done[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_every_architecture_runs_in_executorch_equal_to_phaseloop(case, exported, request):
    if case == "parallel":
        request.getfixturevalue("plugin")
    model, path = exported(case)
    x = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    got = _runtime_logits(PteModel(path), x)
    torch.testing.assert_close(got, _phaseloop_logits(model, x), rtol=0, atol=TOL)
    with torch.no_grad():
        torch.testing.assert_close(got, model(x).logits, rtol=0, atol=TOL)
        if case == "universal+act":  # the halting masks had something to mask
            assert len(model(x).stats["exit_passes"].unique()) == 2
    if CASES[case][2]:
        assert model.trunk.passes == CASES[case][2]


def test_act_program_runs_each_token_until_it_halts(exported):
    """UT + ACT's step methods (program.py), run by the host (program.ActHost): each token
    runs the steps it needs, the earlier positions caught up where a later one needs a step
    they skipped; equal to the program's forward (every step) and to phaseloop, the steps
    each token ran equal to phaseloop's; positions rewritten and a new sequence equal too."""
    model, path = exported("universal+act")
    x = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    adaptive, full = PteModel(path), PteModel(path, adaptive=False)
    assert adaptive.act is not None and full.act is None and full.last_passes is None
    assert adaptive.method is None and full.method is not None  # forward: not loaded for the steps
    steps = []
    got = [adaptive(x[:, :8], 0)]
    steps += adaptive.last_passes
    for t in range(8, 24):
        got.append(adaptive(x[:, t:t + 1], t))
        steps += adaptive.last_passes
    got = torch.cat(got, 1)
    torch.testing.assert_close(got, _runtime_logits(full, x), rtol=0, atol=TOL)
    with torch.no_grad():
        eager = model(x)
    assert steps == eager.stats["exit_passes"][0].tolist()
    assert set(steps) == {1.0, 2.0}  # some tokens stopped after one of the two steps
    y = x.clone()
    y[:, 12:] = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(adaptive(y[:, 12:20], 12), model(y[:, :20]).logits[:, 12:], rtol=0, atol=TOL)
        torch.testing.assert_close(adaptive(y[:, :5], 0), model(y[:, :5]).logits, rtol=0, atol=TOL)
    with pytest.raises(ConfigError, match=r"shape \[1, T\]; got \(2, 1\)"):  # refused before the host runs:
        adaptive(torch.cat([x[:, 5:6]] * 2), 5)  # the sequence is kept (the gap below is refused at 5)
    with pytest.raises(ConfigError, match=r"got \(1, 0\)"):
        adaptive(x[:, 5:5], 5)
    with pytest.raises(ConfigError, match="continues at 5"):
        adaptive(x[:, 6:7], 6)  # a gap: positions 5 was never computed
    with pytest.raises(PhaseloopError, match="program failed on tokens 5 .. 5"):
        adaptive(torch.tensor([[300]]), 5)  # past the vocabulary
    with pytest.raises(ConfigError, match="continues at 0"):  # what the failed call left is forgotten
        adaptive(x[:, 5:6], 5)
    # the cache's zeros travel twice in the file: forward's (every slot), each step's own slot
    from executorch.exir._serialize._program import deserialize_pte_binary

    cache_bytes = sum(b.nbytes for b in prepare(_model("universal+act")).cache.buffers())
    assert sum(len(b.storage) for b in deserialize_pte_binary(path.read_bytes()).mutable_data) == 2 * cache_bytes
    # ExecuTorch's C++ runner loads forward (every step) from the program of many methods
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    (tok := path.with_suffix(".tokenizer.json")).write_bytes(tokenizer_json(ByteTokenizer()))
    pieces, prompt = [], torch.tensor([list(b"the quick")])
    config = GenerationConfig(max_new_tokens=12, temperature=0.0, echo=False)
    TextLLMRunner(str(path), str(tok)).generate("the quick", config, token_callback=pieces.append)
    assert "".join(pieces) == ByteTokenizer().decode(model.generate(prompt, 12, temperature=0)[0, 9:].tolist())
    # `generate FILE.pte`'s loop: the tokens and the steps behind each, as eager decoding's
    record = {"passes": 2, "metadata": {"get_max_seq_len": 32, "get_vocab_size": 256}}
    g = pte_generate(Exported(path, adaptive, None, record), x[:, :8], Options(max_new_tokens=12))
    e = eager_generate(model, x[:, :8], Options(max_new_tokens=12))
    assert g.tokens.tolist() == e.tokens.tolist() and g.passes == e.passes and len(set(g.passes)) == 2


@pytest.fixture(scope="module")
def rope_run(tmp_path_factory):
    from phaseloop.cli import main

    root = tmp_path_factory.mktemp("rope-run")
    corpus = write_corpus(root / "corpus.txt")
    assert main(["train", "--preset", "rope-tiny", "--set", "n_layers=1", "--set", "max_seq_len=32",
                 "--steps", "20", "--batch-size", "4", "--seq-len", "32", "--eval-every", "30",
                 "--eval-windows", "1", "--warmup", "3", "--quiet", "--data", str(corpus),
                 "--out", str(root / "run")]) == 0
    return root / "run", corpus


def _loss(logits_fn, windows):
    """Mean next-token cross-entropy over windows, each a new sequence from position 0."""
    losses = [torch.nn.functional.cross_entropy(logits_fn(w[:, :-1])[0], w[0, 1:]) for w in windows]
    return torch.stack(losses).mean().item()


@pytest.fixture(scope="module")
def cli_files(rope_run, tmp_path_factory):
    """bits (None: fp32) -> the .pte `phaseloop export --format executorch` wrote of the run."""
    from phaseloop.cli import main

    root, files = tmp_path_factory.mktemp("cli-pte"), {}
    for key, flags in ((None, []), (4, ["--bits", "4"]), ("4-head", ["--bits", "4", "--head"])):
        files[key] = root / f"rope-{key or 32}.pte"
        assert main(["export", str(rope_run[0]), "--format", "executorch", "--out", str(files[key]), *flags]) == 0
    return files


def test_the_cli_files_xnnpack_fp32_and_int4_and_executorchs_llm_runner(rope_run, cli_files):
    run, corpus = rope_run
    files = cli_files
    model, _ = load_run(run)
    fp32 = PteModel(files[None])
    x = torch.tensor([list(b"the quick brown fox jumps over t")])[:, :24]
    torch.testing.assert_close(_runtime_logits(fp32, x), _phaseloop_logits(model, x), rtol=0, atol=TOL)
    record = json.loads(files[None].with_suffix(".json").read_text())
    for name, value in record["metadata"].items():
        assert fp32.constant(name) == (value if isinstance(value, list) else [value]), name
    with pytest.raises(ConfigError, match="outside the program's cache of 32"):
        fp32(x[:, :2], 31)
    with pytest.raises(ConfigError, match="position 26 follows 24 positions computed"):
        fp32(x[:, :1], 26)  # a gap: the keys of 24 and 25 were never written

    # ExecuTorch's C++ TextLLMRunner on the file and the tokenizer beside it: it reads the
    # metadata (max_seq_len, BOS, EOS, use_kv_cache, enable_dynamic_shape), prefills the
    # prompt in one call and decodes greedily, as phaseloop generate does
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    pieces = []
    runner = TextLLMRunner(str(files[None]), str(files[None].with_name(record["tokenizer"])))
    runner.generate("the quick", GenerationConfig(max_new_tokens=16, temperature=0.0, echo=False),
                    token_callback=pieces.append)
    prompt = torch.tensor([list(b"the quick")])
    ours = model.generate(prompt, 16, temperature=0)[0, prompt.shape[1]:].tolist()
    assert max(ours) < 128  # ASCII: the runner decodes token by token, phaseloop the whole text
    assert "".join(pieces) == ByteTokenizer().decode(ours)

    # int4: the file against its dequantised reference (the same torchao model, eager)
    reference = prepare(load_run(run)[0])
    quantized = pte.quantize_linears(reference, 4)
    assert quantized == json.loads(files[4].with_suffix(".json").read_text())["quantized_layers"]
    ids = torch.tensor(list(corpus.read_bytes()[:4 * 33]))
    windows = [ids[i * 33:(i + 1) * 33][None] for i in range(4)]
    int4 = PteModel(files[4])
    with torch.no_grad():
        loss_ref = _loss(lambda w: reference(w, torch.arange(w.shape[1])), windows)
        loss_fp32 = _loss(lambda w: model(w).logits, windows)
    loss_pte = _loss(lambda w: int4(w, 0), windows)
    assert abs(loss_pte / loss_ref - 1) <= 1e-3, (loss_pte, loss_ref)
    with torch.no_grad():  # Int8WeightOnlyConfig's file: logits off by more than the logits (1.04 vs 0.75)
        want, got = reference(windows[0][:, :32], torch.arange(32)), int4(windows[0][:, :32], 0)
    assert (got - want).abs().max() <= 0.05 * want.abs().max(), ((got - want).abs().max(), want.abs().max())
    assert abs(loss_ref / loss_fp32 - 1) <= 0.05, (loss_ref, loss_fp32)  # what int4 costs this model
    # the quantised layers' bytes in the int4 file: everything else is the same in both files
    fp32_bytes = sum(4 * model.get_submodule(n[len("model."):]).weight.numel() for n in quantized)
    int4_bytes = fp32_bytes - (files[None].stat().st_size - files[4].stat().st_size)
    assert int4_bytes <= 0.2 * fp32_bytes, (int4_bytes, fp32_bytes)

    # --head: the LM head quantised too, against its own dequantised reference
    with_head = prepare(load_run(run)[0])
    quantized = pte.quantize_linears(with_head, 4, head=True)
    record = json.loads(files["4-head"].with_suffix(".json").read_text())
    assert quantized == record["quantized_layers"] == [*json.loads(files[4].with_suffix(".json").read_text())[
        "quantized_layers"], "model.head"] and record["head"] is True
    with torch.no_grad():
        loss_ref = _loss(lambda w: with_head(w, torch.arange(w.shape[1])), windows)
    loss_pte = _loss(lambda w: PteModel(files["4-head"])(w, 0), windows)
    assert abs(loss_pte / loss_ref - 1) <= 1e-3, (loss_pte, loss_ref)
    head_fp32 = 4 * model.head.weight.numel()  # what quantising the head saved, from the two files
    head_int4 = head_fp32 - (files[4].stat().st_size - files["4-head"].stat().st_size)
    assert head_int4 <= 0.2 * head_fp32, (head_int4, head_fp32)


def test_export_head_refusals(rope_run, capsys, tmp_path):
    """--head: with --bits only, executorch only, never a head tied to the embedding."""
    run, _ = rope_run
    for flags, pattern in ((["--format", "executorch", "--head"], "--head quantises the output head"),
                           (["--format", "hf", "--head"], "--head applies to --format executorch, not hf")):
        code, err = run_cli(["export", run, *flags, "--out", tmp_path / "x.pte"], capsys)
        assert_one_line(code, err, pattern)
    assert not list(tmp_path.iterdir())
    tied = build_model(ModelConfig.from_preset("rope-tiny", n_layers=1, max_seq_len=32, tie_embeddings=True))
    with pytest.raises(ConfigError, match="tied to its embedding"):
        pte.quantize_linears(prepare(tied.eval()), 4, head=True)



def _cli_out(argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``phaseloop ARGV`` in this process."""
    from phaseloop.cli import main

    code = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err.strip()


def test_generate_decodes_a_pte_in_the_runtime_as_the_run_decodes(rope_run, cli_files, capsys, tmp_path):
    """`phaseloop generate FILE.pte`: the run's own tokens (greedy, and sampled with a seed:
    one decoding loop over logits within 1e-4), the file's figures, and one line (exit 2)
    for what a program cannot do and for a file that is not its record's."""
    run, _ = rope_run
    fp32 = cli_files[None]
    record = json.loads(fp32.with_suffix(".json").read_text())
    for extra in (["--temperature", "0"], ["--temperature", "1", "--seed", "5", "--top-k", "40"]):
        got = {}
        for name, target in (("run", run), ("pte", fp32)):
            code, out, err = _cli_out(["generate", target, "--prompt", "the qu", "--max-new-tokens", "24",
                                       "--json", *extra], capsys)
            assert code == 0, err
            got[name] = json.loads(out)
        assert got["pte"]["tokens"] == got["run"]["tokens"] and len(got["pte"]["tokens"]) == 24, extra
        assert got["pte"]["text"] == got["run"]["text"] and got["pte"]["prompt"] == "the qu"
    pte_out = got["pte"]
    assert pte_out["engine"] == "executorch" and pte_out["program_bytes"] == fp32.stat().st_size
    cfg = load_run(run)[0].cfg  # rope-tiny, one layer: one slot of keys and values, 32 positions
    assert pte_out["kv_cache_bytes"] == record["kv_cache_bytes"] == 2 * cfg.n_kv_heads * 32 * cfg.head_dim * 4
    assert pte_out["depth"] is None and pte_out["mean_passes"] is None  # a stack
    code, out, err = _cli_out(["generate", fp32, "--prompt", "the", "--max-new-tokens", "8"], capsys)
    assert code == 0 and out.startswith("the") and len(out.encode()) > 3, (out, err)
    code, out, err = _cli_out(["generate", cli_files[4], "--prompt", "the", "--max-new-tokens", "8", "--json"],
                              capsys)
    assert code == 0 and len(json.loads(out)["tokens"]) == 8 and json.loads(out)["bits"] == 4, err

    for flags, pattern in ((["--depth", "2"], "--depth with a .pte"),
                           (["--quantized", "q.safetensors"], "--quantized with a .pte"),
                           (["--exit", "kl:0.1"], "--exit with a .pte"),
                           (["--kv-share", "1"], "--kv-share with a .pte"),
                           (["--kv-fill", "latest"], "--kv-fill with a .pte"),
                           (["--speculative", "1"], "--speculative with a .pte"),
                           (["--no-cache"], "--no-cache with a .pte"),
                           (["--max-new-tokens", "40"], r"need 42 positions; rope-32.pte holds 32")):
        code, err = run_cli(["generate", fp32, "--prompt", "the", *flags], capsys)
        assert_one_line(code, err, pattern)
    # a damaged copy (one byte changed), a copy without its tokenizer, a file that is not there
    bad = tmp_path / "bad.pte"
    for src, dst in ((fp32, bad), *zip(sidecars(fp32), sidecars(bad))):
        shutil.copyfile(src, dst)
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 1
    bad.write_bytes(bytes(data))
    code, err = run_cli(["generate", bad], capsys)
    assert_one_line(code, err, "is not the file its record bad.json describes")
    shutil.copyfile(fp32, bad)
    sidecars(bad)[0].unlink()
    code, err = run_cli(["generate", bad], capsys)
    assert_one_line(code, err, "its tokenizer bad.tokenizer.json is missing")
    code, err = run_cli(["generate", tmp_path / "none.pte"], capsys)
    assert_one_line(code, err, "none.pte: no such .pte file")
    _damaged_sidecars_are_refused(fp32, tmp_path, capsys)


def _copy(pte_file, dst):
    for s, d in ((pte_file, dst), *zip(sidecars(pte_file), sidecars(dst))):
        shutil.copyfile(s, d)
    return dst


def _damaged_sidecars_are_refused(fp32, tmp_path, capsys):
    """A record that is not one, a replaced tokenizer, a folder or a symlink loop where a
    file should be: one line each, never taken for a missing file; a prompt id past the
    program's vocabulary is refused before the program runs."""
    from phaseloop.deploy.generate import generate, open_pte
    from phaseloop.inference import Options

    rec = json.loads(sidecars(fp32)[1].read_text())
    meta = rec["metadata"]
    for name, edited in (("list", [1, 2]),
                         ("nolen", {**rec, "metadata": {k: v for k, v in meta.items() if k != "get_max_seq_len"}}),
                         ("strlen", {**rec, "metadata": {**meta, "get_max_seq_len": "32"}}),
                         ("passes", {**rec, "passes": "6"})):
        p = _copy(fp32, tmp_path / f"{name}.pte")
        sidecars(p)[1].write_text(json.dumps(edited))
        code, err = run_cli(["generate", p], capsys)
        assert_one_line(code, err, "is not the record of an ExecuTorch export")
    assert rec["record_sha256"] == record_digest(rec)  # export digests its record
    for name, edited in (("len", {**rec, "metadata": {**meta, "get_max_seq_len": meta["get_max_seq_len"] + 1}}),
                         ("digest", {**rec, "record_sha256": "0" * 64})):  # of the record's own shape
        p = _copy(fp32, tmp_path / f"{name}.pte")
        sidecars(p)[1].write_text(json.dumps(edited))
        code, err = run_cli(["generate", p], capsys)
        assert_one_line(code, err, f"{name}.json is damaged or was edited")
    p = _copy(fp32, tmp_path / "older.pte")  # an export from before records were digested
    sidecars(p)[1].write_text(json.dumps({k: v for k, v in rec.items() if k != "record_sha256"}))
    assert open_pte(p).record["pte_sha256"] == rec["pte_sha256"]
    p = _copy(fp32, tmp_path / "tok.pte")
    tok = sidecars(p)[0]
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=1))  # the same vocabulary, another file
    code, err = run_cli(["generate", p], capsys)
    assert_one_line(code, err, "is not the tokenizer its record tok.json describes")
    p = _copy(fp32, tmp_path / "dir.pte")
    sidecars(p)[1].unlink()
    sidecars(p)[1].mkdir()
    code, err = run_cli(["generate", p], capsys)
    assert_one_line(code, err, "its record dir.json is a folder")
    loop = tmp_path / "loop.pte"
    loop.symlink_to(loop)
    code, err = run_cli(["generate", loop], capsys)
    assert_one_line(code, err, "is a symlink loop")
    exp = open_pte(fp32)
    with pytest.raises(ConfigError, match="token id 300, outside rope-32.pte's vocabulary of 256"):
        generate(exp, torch.tensor([[5, 300]]), Options(max_new_tokens=2))


def test_export_refuses_a_checkpoint_that_changes_while_read(rope_run, tmp_path, monkeypatch, capsys):
    """The record names the weights exported: a checkpoint rewritten while the export read
    it (a trainer saving) is refused; a name taken while the export wrote is left alone."""
    import phaseloop.deploy.run as deploy_run

    run = shutil.copytree(rope_run[0], tmp_path / "run")
    load = deploy_run.load_run

    def saving_meanwhile(*a, **k):
        out = load(*a, **k)
        with open(run / "checkpoint" / "model.safetensors", "ab") as f:
            f.write(b" ")
        return out

    monkeypatch.setattr(deploy_run, "load_run", saving_meanwhile)
    code, err = run_cli(["export", run, "--format", "executorch", "--out", tmp_path / "m.pte"], capsys)
    assert_one_line(code, err, "its checkpoint changed while it was read")
    assert not (tmp_path / "m.pte").exists()
    a, b = tmp_path / "a.json", tmp_path / "b.pte"
    b.write_bytes(b"mine")
    with pytest.raises(PhaseloopError, match="appeared while it was being written"):
        deploy_run.write_all([(a, b"1"), (b, b"2")])
    assert b.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["b.pte", "run"]
