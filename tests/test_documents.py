"""Windows that hold several documents (issue 28): with document positions and the
document mask, a window spanning two documents equals the two documents run separately,
for every trunk; the batches carry each token's document and position."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model_config

from phaseloop import ConfigError
from phaseloop.models import build_model

pytestmark = pytest.mark.usefixtures("one_thread")

TRUNKS = [("rope", {}), ("three_phase", {}), ("universal", {}), ("universal", {"act": True}),
          ("looped", {}), ("hyperloop", {}), ("hyperloop", {"hc_per_layer": True}), ("mhc", {})]


tiny = tiny_model_config


@pytest.mark.parametrize("arch,over", TRUNKS, ids=lambda v: v if isinstance(v, str) else "-".join(v) or "base")
def test_a_window_of_two_documents_equals_each_alone(arch, over):
    torch.manual_seed(0)
    model = build_model(tiny(arch, **over)).double().eval()
    a, b = torch.randint(0, 40, (2, 5)), torch.randint(0, 40, (2, 7))
    window = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, -1)
    doc_ids = torch.tensor([0] * 5 + [1] * 7).expand(2, -1)
    with torch.no_grad():
        got = model(window, positions_BT=positions, doc_ids_BT=doc_ids).logits
        alone_a, alone_b = model(a).logits, model(b).logits
        plain = model(window).logits
    torch.testing.assert_close(got[:, :5], alone_a, rtol=0, atol=1e-10)
    torch.testing.assert_close(got[:, 5:], alone_b, rtol=0, atol=1e-10)
    assert not torch.allclose(plain[:, 5:], alone_b)  # without the options B sees A


def test_each_option_alone():
    """The mask alone keeps the window's positions; the positions alone keep attention."""
    torch.manual_seed(0)
    model = build_model(tiny("three_phase")).double().eval()
    a, b = torch.randint(0, 40, (1, 5)), torch.randint(0, 40, (1, 7))
    window = torch.cat([a, b], 1)
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    doc_ids = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        masked = model(window, doc_ids_BT=doc_ids).logits
        restarted = model(window, positions_BT=positions).logits
        plain = model(window).logits
    torch.testing.assert_close(masked[:, :5], plain[:, :5], rtol=1e-12, atol=1e-12)  # A is first: unchanged
    assert not torch.allclose(masked[:, 5:], model(b).logits.detach())  # B at positions 5.. (horn, RoPE)
    torch.testing.assert_close(restarted[:, :5], plain[:, :5], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(restarted[:, 5:], plain[:, 5:])


def test_refusals():
    model = build_model(tiny("rope"))
    x = torch.randint(0, 40, (1, 4))
    with pytest.raises(ConfigError, match=r"must be \[batch, tokens\]"):
        model(x, positions_BT=torch.arange(4))
    from phaseloop.layers import KVCache
    with pytest.raises(ConfigError, match="not to cached decoding"):
        model(x, cache=KVCache(), doc_ids_BT=torch.zeros(1, 4, dtype=torch.long))
    pooled = build_model(tiny("hyperloop", hc_transition="pooled_mlp"))
    with pytest.raises(ConfigError, match="pooled_mlp"):
        pooled(x, doc_ids_BT=torch.zeros(1, 4, dtype=torch.long))


def test_documents_inputs_restart_at_each_start():
    from phaseloop.data import Documents

    docs = Documents(np.array([0, 4, 9]), mask=True, positions=True)
    got = docs.inputs([2, 6], 6)
    assert got["doc_ids_BT"].tolist() == [[0, 0, 1, 1, 1, 1], [1, 1, 1, 2, 2, 2]]
    # the first, partial document counts from the window start
    assert got["positions_BT"].tolist() == [[0, 1, 0, 1, 2, 3], [0, 1, 2, 0, 1, 2]]
    assert set(Documents(np.array([0]), positions=True).inputs([3], 4)) == {"positions_BT"}


def _folder(tmp_path):
    d = tmp_path / "docs"
    d.mkdir()
    for i, word in enumerate(["alpha beta ", "gamma delta ", "epsilon zeta "]):
        (d / f"doc{i}.txt").write_text(word * 60)
    return d


def test_train_eval_and_resume_with_document_options(tmp_path, capsys):
    from conftest import TINY, run_cli

    from phaseloop.data import Documents, load_corpus

    data = _folder(tmp_path)
    corpus = load_corpus(str(data))
    assert len(corpus.doc_starts) == 3
    train_tok, val_tok = corpus.split(0.1, 33)
    docs = Documents.of(corpus, train_tok, True, True)
    assert docs.starts.tolist() == [int(s) for s in corpus.doc_starts if s < len(train_tok)]
    out = tmp_path / "run"
    argv = ["train", *TINY, "--data", str(data), "--steps", "4", "--eval-every", "2", "--ckpt-every", "2",
            "--seq-len", "32", "--doc-mask", "--doc-positions", "--out", str(out)]
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    import json
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["train"]["doc_mask"] and cfg["train"]["doc_positions"]
    code, err = run_cli(["eval", str(out), "--json", "--windows", "4"], capsys)
    assert code == 0, err
    code, err = run_cli(["train", "--resume", "--out", str(out), "--quiet"], capsys)
    assert code == 0, err  # the recorded options: a finished run, nothing new
    code, err = run_cli(["train", "--resume", "--out", str(out), "--quiet", "--no-doc-mask"], capsys)
    assert code == 2 and "doc_mask: true there, false now" in err.lower(), err


def test_a_module_that_cannot_mask_documents_is_refused_before_the_run_folder(tmp_path, capsys):
    """pooled_mlp with --doc-mask: refused in one line before config.json is written (it was
    refused in the first forward, and the config.json left behind blocked every retry)."""
    from conftest import run_cli

    out = tmp_path / "pm"
    argv = ["train", "--preset", "hyperloop-tiny", "--set", "hc_transition=pooled_mlp", "--data",
            str(_folder(tmp_path)), "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--compile", "off",
            "--quiet", "--out", str(out)]
    code, err = run_cli(argv + ["--doc-mask"], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "drop --doc-mask" in err, err
    assert not (out / "config.json").exists()
    code, err = run_cli(argv, capsys)  # the advice followed: it trains
    assert code == 0, err


def test_task_runs_refuse_document_options():
    from phaseloop.engine import TrainConfig
    from phaseloop.tasks.task_model import train_pairs

    with pytest.raises(ConfigError, match="doc_mask / doc_positions apply to LM runs"):
        train_pairs(tiny("rope"), [], TrainConfig(doc_mask=True))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("arch", ["rope", "three_phase"])
def test_flex_attention_path_equals_the_sdpa_mask(arch, monkeypatch):
    """FlexAttention (used on CUDA, docattn) through eager flex_attention on CPU: the same
    logits as SDPA with the dense block mask, within 1e-5 in float32 (GQA included); a
    window of two documents still equals each alone (float64)."""
    from phaseloop import docattn

    if docattn._flex() is None:
        pytest.skip("this torch has no torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    model = build_model(tiny(arch, n_heads=6, n_kv_heads=3 if arch == "rope" else 6, d_model=36)).eval()
    x = torch.randint(0, 40, (3, 20))
    doc_ids = torch.tensor([[0] * 7 + [1] * 13, [0] * 20, [0] * 3 + [1] * 5 + [2] * 12])
    positions = torch.tensor([list(range(7)) + list(range(13)), list(range(20)),
                              list(range(3)) + list(range(5)) + list(range(12))])
    calls = []
    real_attend = docattn.attend
    with torch.no_grad():
        sdpa = model(x, positions_BT=positions, doc_ids_BT=doc_ids).logits
        monkeypatch.setattr(docattn, "wanted", lambda q, p: p == 0.0)
        monkeypatch.setattr(docattn, "attend", lambda *a: calls.append(1) or real_attend(*a))
        flex = model(x, positions_BT=positions, doc_ids_BT=doc_ids).logits
    assert len(calls) == model.cfg.n_layers  # every layer took the flex path
    torch.testing.assert_close(flex, sdpa, rtol=0, atol=1e-5)
    model = model.double()
    a, b = torch.randint(0, 40, (1, 5)), torch.randint(0, 40, (1, 7))
    with torch.no_grad():
        got = model(torch.cat([a, b], 1), positions_BT=torch.cat([torch.arange(5), torch.arange(7)])[None],
                    doc_ids_BT=torch.tensor([[0] * 5 + [1] * 7])).logits
        torch.testing.assert_close(got[:, :5], model(a).logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(got[:, 5:], model(b).logits, rtol=0, atol=1e-10)


def test_wikitext_rows_of_a_dataset_are_grouped_into_articles(tmp_path, data_dir):
    """hf:Salesforce/wikitext holds one row per line of the raw file: read as WikiText
    (its name), its rows make the same articles and the same bytes as the raw file."""
    datasets = pytest.importorskip("datasets")
    from phaseloop.data import load_corpus

    raw = (data_dir / "wikitext-2" / "wiki.valid.raw").read_bytes()
    rows = [line.decode() for line in raw.splitlines(keepends=True)]
    datasets.Dataset.from_dict({"text": rows}, info=datasets.DatasetInfo(dataset_name="wikitext")).save_to_disk(
        str(tmp_path / "saved"))
    grouped, from_file = load_corpus(tmp_path / "saved"), load_corpus(data_dir / "wikitext-2" / "wiki.valid.raw")
    assert len(grouped.doc_starts) == len(from_file.doc_starts) == 60
    assert bytes(grouped.tokens[:]) == raw and grouped.doc_starts.tolist() == from_file.doc_starts.tolist()
    datasets.Dataset.from_dict({"text": rows[:50]}).save_to_disk(str(tmp_path / "other"))
    assert len(load_corpus(tmp_path / "other").doc_starts) == 50  # any other dataset: a document per row


def test_wikitext_articles_by_name_with_crlf_and_never_from_a_store_of_other_documents(tmp_path, data_dir):
    """The same bytes named as a plain file are one document, named as WikiText its 60
    articles, whichever was read first (the store of one is not reused for the other); a
    copy with CRLF line ends has the same articles."""
    from phaseloop.data import load_corpus

    raw = (data_dir / "wikitext-2" / "wiki.valid.raw").read_bytes()
    for name, data in (("a/plain.txt", raw), ("b/wiki.valid.raw", raw), ("c/wiki.valid.raw",
                                                                          raw.replace(b"\n", b"\r\n"))):
        (tmp_path / name).parent.mkdir()
        (tmp_path / name).write_bytes(data)
    assert len(load_corpus(tmp_path / "a/plain.txt").doc_starts) == 1
    wiki = load_corpus(tmp_path / "b/wiki.valid.raw")
    assert len(wiki.doc_starts) == 60
    crlf = load_corpus(tmp_path / "c/wiki.valid.raw")
    assert len(crlf.doc_starts) == 60 and bytes(crlf.tokens[:]) == raw.replace(b"\n", b"\r\n")
