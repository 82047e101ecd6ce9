"""Task runner: answer-only loss, greedy decoding with the KV cache, position offsets,
a tiny model learning copy, metrics JSON + plot, and the task/babi/demo commands."""

import json

import pytest
import torch
import torch.nn.functional as F

from phaseloop.cli import main
from phaseloop.config import ModelConfig
from phaseloop.layers import KVCache
from phaseloop.model import build_model
from phaseloop.tasks import CharVocab, Example, TaskSpec
from phaseloop.tasks.babi import WordVocab
from phaseloop.tasks.babi_runner import run_babi
from phaseloop.tasks.report import length_metrics
from phaseloop.tasks.runner import algorithmic_data, run_examples, task_model_config
from phaseloop.tasks.task_model import (
    DecoderTaskModel,
    build_task_model,
    decode_pairs,
    decoder_batch,
    encode_pairs,
    task_model_class,
    task_train_config,
)

TINY = dict(arch="rope", d_model=32, n_layers=2, n_heads=2, d_ff=64, vocab_size=14, max_seq_len=32)
TINY_SET = ["--set", "d_model=32", "--set", "n_heads=2", "--set", "n_kv_heads=2", "--set", "d_ff=64"]


def test_decoder_batch_masks_everything_but_the_answer():
    v = CharVocab()
    pairs = encode_pairs([Example("123", "321", 3), Example("4", "4", 1)], v)
    idx, tgt = decoder_batch(pairs)
    # row 0: 1 2 3 SEP 3 2 1 EOS -> inputs drop the last token, targets shift by one
    assert idx[0].tolist() == v.encode("123") + [v.SEP] + v.encode("321")
    assert tgt[0].tolist() == [-100] * 3 + v.encode("321") + [v.EOS]
    # row 1 is right-padded: PAD inputs, -100 targets past its EOS
    assert idx[1].tolist() == v.encode("4") + [v.SEP] + v.encode("4") + [v.PAD] * 4
    assert tgt[1].tolist() == [-100] + v.encode("4") + [v.EOS] + [-100] * 4


def test_loss_counts_answer_tokens_only():
    """The loss is the mean CE over answer tokens + EOS; prompt predictions get zero
    gradient, so changing what the prompt positions predict cannot change it."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(**TINY))
    pairs = encode_pairs([Example("1234", "4321", 4), Example("56", "65", 2)], CharVocab())
    idx, tgt = decoder_batch(pairs)
    out = model(idx, tgt)
    out.logits.retain_grad()
    out.loss.backward()
    ans = tgt != -100
    manual = F.cross_entropy(out.logits[ans], tgt[ans])
    torch.testing.assert_close(out.ce_loss, manual)
    assert ans.sum() == (4 + 1) + (2 + 1)
    assert out.logits.grad[~ans].abs().max() == 0
    assert out.logits.grad[ans].abs().max() > 0
    # logits at prompt positions replaced by anything: same loss
    noisy = out.logits.detach().clone()
    noisy[~ans] = torch.randn_like(noisy[~ans]) * 10
    torch.testing.assert_close(F.cross_entropy(noisy.flatten(0, 1), tgt.flatten(), ignore_index=-100),
                               out.ce_loss.detach())


def test_tiny_model_learns_copy():
    spec = TaskSpec("copy", (1, 5), [3, 5])
    tc = task_train_config(steps=300, lr=3e-3, warmup_steps=20)
    train, test = algorithmic_data(spec, tc.steps * tc.batch_size, 40, seed=0)
    res = run_examples(ModelConfig(**TINY), train, test, tc)
    assert res["final_loss"] < 0.2
    assert res["char_acc"] > 0.95 and res["seq_acc"] > 0.85
    assert set(res["per_length"]) == {3, 5}


def test_an_answer_runs_its_own_slack_whatever_its_batch():
    """A row decodes up to len(its target) + slack tokens, also beside a longer target in
    its chunk (it ran to the longest + slack, so its character accuracy hung on its batch),
    and its ponder covers the positions it used (universal-act-tiny: an ACT model)."""
    v = CharVocab()
    torch.manual_seed(0)
    tm = DecoderTaskModel(build_model(ModelConfig.from_preset("universal-act-tiny", vocab_size=len(v))).eval())
    short, long = encode_pairs([Example("12", "34", 2), Example("12", "34567", 2)], v)
    tm.greedy = lambda sources, max_new, device: (torch.full((len(sources), max_new), v.encode("9")[0]),
                                                  torch.ones(len(sources), len(sources[0]) + 1 + max_new))
    tm.answer_position = lambda L: 0
    together = decode_pairs(tm, [short, long], batch_size=2)
    alone = decode_pairs(tm, [short], batch_size=2)
    assert [len(x) for x in together.ids] == [2 + 1 + 1, 5 + 1 + 1]  # target + EOS + slack 1
    assert together.ids[0] == alone.ids[0] and torch.equal(together.ponder[0], alone.ponder[0])
    assert together.ponder[0].shape[0] == 2 + 1 + 4  # prompt, SEP and the 4 tokens fed back


@pytest.mark.parametrize("preset", ["rope-tiny", "universal-act-tiny"])
def test_greedy_with_cache_matches_uncached_argmax(preset):
    v = CharVocab()
    cfg = ModelConfig.from_preset(preset, vocab_size=len(v))
    torch.manual_seed(0)
    tm = DecoderTaskModel(build_model(cfg).eval())
    pairs = encode_pairs(TaskSpec("reverse", (4, 4)).train(3), v)
    dec = decode_pairs(tm, pairs, batch_size=2)
    for (src, tgt), got in zip(pairs, dec.ids):
        seq = src + [v.SEP]
        for _ in range(len(tgt) + 1):
            nxt = int(tm.model(torch.tensor([seq])).logits[0, -1].argmax())
            if nxt == v.EOS:
                break
            seq.append(nxt)
        assert got == seq[len(src) + 1:]
    if cfg.act:  # ponder per position processed, each in [1, max steps]
        row = dec.ponder[0]
        assert row.shape[0] >= len(pairs[0][0]) + 1
        assert row.min() >= 1 and row.max() <= cfg.act_steps + 1
        examples = [Example("abcd", "dcba", 4)] * 3
        m = length_metrics(examples, ["dcba"] * 3, dec.ponder)[4]
        assert 1 <= m["ponder_mean"] <= cfg.act_steps + 1 and m["ponder_std"] >= 0


def test_position_offset_is_a_start_position_shift():
    """The offset shifts absolute positions: RoPE alone is relative, so the loss is
    unchanged; the UT's absolute sinusoid sees the shift."""
    v = CharVocab()
    pairs = encode_pairs(TaskSpec("copy", (3, 3)).train(2), v)
    for cfg, same in ((ModelConfig(**TINY), True),
                      (ModelConfig.from_preset("universal-tiny", vocab_size=len(v)), False)):
        torch.manual_seed(0)
        tm = DecoderTaskModel(build_model(cfg).eval())
        with torch.no_grad():
            base = tm.loss(pairs, 0).ce_loss
            shifted = tm.loss(pairs, 17).ce_loss
        assert torch.allclose(base, shifted, atol=1e-5) == same
    # and the offset is exactly an empty cache at pos=offset
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("universal-tiny", vocab_size=len(v))).eval()
    idx, _ = decoder_batch(pairs)
    with torch.no_grad():
        cache = KVCache(pos=5)
        model(idx, cache=cache)
    assert cache.pos == 5 + idx.shape[1]


def test_word_vocab_roundtrip():
    v = WordVocab.for_texts(["Mary went to the kitchen. Where is Mary?", "kitchen"])
    ids = v.encode("Where is Mary?", add_eos=True)
    assert ids[-1] == v.EOS and v.decode(ids) == "where is mary ?"


def test_babi_runner_reports_errors_and_ponder(data_dir):
    cfg = ModelConfig.from_preset("universal-act-tiny", d_model=32, n_heads=2, n_kv_heads=2, d_ff=64)
    res = run_babi(cfg, data_dir / "babi" / "en-1k", [1], task_train_config(steps=3), max_test=20,
                   max_sentences=6)
    assert set(res["errors"]) == {1} and 0 <= res["errors"][1] <= 1
    assert res["failed"] in ([], [1])
    assert set(res["ponder_by_supporting"][1]) == {1}  # task 1: one supporting fact
    mean, std = res["ponder_by_supporting"][1][1]
    assert 1 <= mean <= cfg.act_steps + 1 and std >= 0
    assert 0 < res["supporting_in_window"][1] <= 1


def test_task_model_config_defaults_and_mismatch():
    cfg, arch = task_model_config("universal", None)
    assert cfg.arch == "universal" and arch is None
    assert task_model_config("three_phase", None)[0].arch == "three_phase"
    with pytest.raises(Exception, match="not --arch"):
        task_model_config("rope", "universal-tiny")


# ----------------------------------------------------------------------------- CLI
def test_cli_task_writes_metrics_and_plot(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["task", "--task", "reverse", "--arch", "rope", *TINY_SET, "--train-len", "2-4",
               "--test-len", "4,8", "--steps", "4", "--seeds", "0,1", "--n-test", "5",
               "--out", str(out), "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "char acc" in text and "seq acc" in text
    m = json.loads((out / "metrics.json").read_text())
    assert m["seeds"] == [0, 1] and len(m["per_seed"]) == 2
    assert set(m["summary"]["per_length"]) == {"4", "8"}
    assert m["summary"]["per_length"]["8"]["n"] == 5
    assert (out / "accuracy_vs_length.png").read_bytes()[:4] == b"\x89PNG"
    # a second run never overwrites the first
    assert main(["task", "--task", "copy", "--out", str(out), "--quiet"]) == 2
    assert "not empty" in capsys.readouterr().err
    # one run folder per seed, as `phaseloop train` writes them
    for s in (0, 1):
        seed_dir = out / f"seed-{s}"
        assert (seed_dir / "checkpoint" / "model.safetensors").exists()
        assert json.loads((seed_dir / "config.json").read_text())["task"]["task"] == "reverse"
        assert (seed_dir / "summary.json").exists() and (seed_dir / "metrics.jsonl").exists()


def test_cli_task_jsonl(tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"input": s, "target": s[::-1]}) + "\n"
                            for s in ["abc", "ba", "cab", "aab", "bca", "cc", "a", "bb", "abca", "cba"]))
    rc = main(["task", "--task", f"jsonl:{data}", *TINY_SET, "--steps", "3", "--out",
               str(tmp_path / "run"), "--quiet"])
    assert rc == 0
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["task"].startswith("jsonl:")


def test_cli_bad_jsonl_exits_2_naming_the_line(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input": "ab", "target": "ba"}\n\n{"input": "ab", "target": 12}\n')
    rc = main(["task", "--task", f"jsonl:{data}", "--steps", "1", "--out", str(tmp_path / "r"),
               "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and f"{data}:3:" in err and "'target' must be a string" in err


@pytest.mark.parametrize("argv", [["task", "--task", "sort"], ["task", "--task", "copy", "--seeds", "a"],
                                  ["task", "--task", "copy", "--arch", "nope"],
                                  ["babi", "--tasks", "x"]])
def test_cli_task_bad_input_exits_2(argv, tmp_path, capsys):
    assert main(argv + ["--out", str(tmp_path / "r"), "--quiet"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_cli_demo_parity(capsys):
    assert main(["demo", "parity", "--length", "100"]) == 0
    out = capsys.readouterr().out
    assert "length n = 100" in out
    assert "solved in 7 steps = ceil(log2 100)" in out
    assert "fails from position 65 = 2^6 + 1" in out


@pytest.mark.parametrize("arch,over", [("transformer-seq2seq", {}), ("universal-seq2seq", {"act": True})])
def test_seq2seq_greedy_matches_library_decoder_and_offsets_pad_source(arch, over):
    from phaseloop.decoding import until_eos

    v = CharVocab()
    cfg, arch = task_model_config(arch, None, {"vocab_size": len(v), **over})
    torch.manual_seed(0)
    tm = task_model_class(arch)(build_task_model(cfg, arch))
    tm.model.eval()
    pairs = encode_pairs(TaskSpec("copy", (3, 3)).train(4), v)
    dec = decode_pairs(tm, pairs, batch_size=4)
    ref = until_eos(tm.model.generate(torch.tensor([s for s, _ in pairs]), 5, bos_id=v.SEP,
                                      eos_id=v.EOS).tolist(), v.EOS)
    assert dec.ids == [r[:len(d)] for r, d in zip(ref, dec.ids)]
    if cfg.act:  # encoder positions then decoder positions
        assert dec.ponder[0].shape[0] >= 3 + 1 and dec.ponder[0].min() >= 1
    with torch.no_grad():  # offset = left PAD (masked keys) + decoder start shift: finite loss
        assert torch.isfinite(tm.loss(pairs, 7).ce_loss)


@pytest.mark.parametrize("arch", ["rope", "three_phase", "looped", "hyperloop", "mhc", "universal"])
def test_every_decoder_arch_trains_and_decodes(arch):
    cfg, _ = task_model_config(arch, None)
    spec = TaskSpec("parity", (2, 4), [6])
    train, test = algorithmic_data(spec, 8, 2, seed=0)
    res = run_examples(cfg, train, test, task_train_config(steps=2, batch_size=4), max_offset=3)
    assert res["model"]["arch"] == arch and len(res["preds"]) == 2
    assert set(res["per_length"]) == {6}


def test_auto_offset_reaches_the_longest_test_position():
    from phaseloop.tasks.runner import auto_offset

    train = [([3] * 8, [3] * 8 + [1])]  # 8 in, 8 + EOS out
    test = [([3] * 32, [3] * 32 + [1])]
    # decoder-only: joined length 8+1+9 -> 32+1+33 ; encoder-decoder: each side apart
    assert auto_offset(train, test) == (32 + 1 + 33) - (8 + 1 + 9)
    assert auto_offset(train, test, seq2seq=True) == 24
    assert auto_offset(test, train) == 0
