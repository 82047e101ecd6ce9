"""Reliability, issue 24 classes 3, 5 and 9 (docs/reliability.md): text that is not what it
should be, damaged token stores, and messages that name the file and the fix. Each bad
input ends with exit 2, one line `phaseloop: error: ...`, no traceback, and every file
(the run, the inputs, the token store) byte-identical afterwards."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, write_corpus

from phaseloop.cli import main
from phaseloop.data import load_corpus
from phaseloop.data import store as token_store
from phaseloop.data.sources import resolve
from phaseloop.errors import CheckpointError, DataError

TINY = ["--preset", "rope-tiny", "--batch-size", "2", "--eval-windows", "2", "--warmup", "2", "--quiet",
        "--steps", "2"]


def snapshot(*roots) -> dict:
    """Every file's bytes and every folder (an empty folder left behind counts as a change);
    the store's verified.json is a cache of the check, not content."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.name != "verified.json":
                out[str(p)] = p.read_bytes() if p.is_file() else None
    return out



def refused(argv, capsys, pattern, *roots):
    """Exit 2, one line naming ``pattern``, no traceback, nothing under ``roots`` changed."""
    before = snapshot(*roots)
    code, err = run_cli(argv, capsys)
    assert code == 2, err
    lines = [line for line in err.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("phaseloop: error: ") and pattern in lines[0], err
    assert snapshot(*roots) == before
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # the session's cache, as conftest gives each test
        mp.setenv("PHASELOOP_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield _world(tmp_path_factory)


def _world(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("text")
    text = write_corpus(root / "corpus.txt")
    for name, vocab in (("nounk", {"the": 0, "fox": 1}), ("emptyv", {})):
        t = Tokenizer(models.WordLevel(vocab, unk_token=None))
        t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        (root / name).mkdir()
        t.save(str(root / name / "tokenizer.json"))
    t = Tokenizer(models.BPE({"#": 0}, []))  # no unknown token: drops every other character
    t.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (root / "nocover").mkdir()
    t.save(str(root / "nocover" / "tokenizer.json"))
    assert main(["tokenizer", "train", "--data", str(text), "--kind", "bpe", "--vocab-size", "300",
                 "--out", str(root / "bpe"), "--quiet"]) == 0
    assert main(["train", *TINY, "--data", str(text), "--out", str(root / "run")]) == 0
    good = ["ok text here " * 20] * 30
    for kind, bad in {"list": ["a", "b"], "object": {"a": 1}, "boolean": True, "number": 3.5}.items():
        (root / f"{kind}.jsonl").write_text("".join(json.dumps({"text": v}) + "\n" for v in good + [bad]))
    (root / "empties.jsonl").write_text("".join(json.dumps({"text": v}) + "\n" for v in ["", None, ""]))
    (root / "ws.txt").write_text(" \n\t  \n" * 100)
    (root / "r.toml").write_bytes(b'name = "caf\xe9"\nvariants = ["rope"]\n')
    os.mkfifo(root / "fifo")
    return {"root": root, "text": text, "run": root / "run", "bpe": root / "bpe"}


# ---------------------------------------------------------------------------- class 3: text
def _cases3():
    u = "\udcff"  # a non-UTF-8 byte of a command-line argument, as Python keeps it
    return [
        (["tokenizer", "encode", "-t", "{root}/nounk", "the cat"], "cannot encode the word 'cat'"),
        (["train", *TINY, "--data", "{text}", "--tokenizer", "{root}/nounk", "--out", "{root}/x"],
         "no unknown token"),
        (["tokenizer", "stats", "-t", "{root}/nounk", "--data", "{text}"], "cannot encode the word 'quick'"),
        (["tokenizer", "encode", f"ab{u}c"], "not UTF-8 (byte 0xff at character 2"),
        (["tokenizer", "encode", "-t", "{bpe}", f"the {u}"], "not UTF-8 (byte 0xff"),
        (["tokenizer", "encode", "-t", "{root}/nounk", f"the {u}"], "not UTF-8 (byte 0xff"),
        (["generate", "{run}", "--prompt", f"ab{u}", "--max-new-tokens", "2"], "not UTF-8"),
        (["train", *TINY, "--data", "{root}/list.jsonl", "--out", "{root}/x"], "list.jsonl:31: 'text' is a list"),
        (["train", *TINY, "--data", "{root}/object.jsonl", "--out", "{root}/x"], "'text' is an object"),
        (["train", *TINY, "--data", "{root}/boolean.jsonl", "--out", "{root}/x"], "'text' is a boolean (True)"),
        (["tokenizer", "stats", "--data", "{root}/number.jsonl"], "number.jsonl:31: 'text' is a number (3.5)"),
        (["train", *TINY, "--data", "{root}/empties.jsonl", "--out", "{root}/x"],
         "its 3 records are all empty or null"),
        (["tokenizer", "stats", "--data", "{root}/empties.jsonl"], "all empty or null"),  # no progress bar
        (["train", *TINY, "--data", "{root}/ws.txt", "--out", "{root}/x"], "holds only whitespace (600 bytes)"),
        (["tokenizer", "train", "--data", "{root}/ws.txt", "--kind", "bpe", "--vocab-size", "300",
          "--out", "{root}/x", "--quiet"], "holds only whitespace"),
    ]


def fill(argv, w):
    return [str(a).format(**{k: str(v) for k, v in w.items()}) for a in argv]


@pytest.mark.parametrize("argv,pattern", _cases3())
def test_text_that_is_not_text_is_refused(world, capsys, argv, pattern):
    cache = Path(os.environ["PHASELOOP_CACHE"])  # no store (or its temporary folder) left behind
    refused(fill(argv, world), capsys, pattern, world["root"], cache)


def test_parquet_records_that_are_not_text_or_all_null(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [[1, 2], [3]]}), tmp_path / "l.parquet")
    pq.write_table(pa.table({"text": ["fine text"] * 3 + [None], "n": [1, 2, 3, 4]}), tmp_path / "n.parquet")
    pq.write_table(pa.table({"text": pa.array([None, None], pa.string())}), tmp_path / "null.parquet")
    with pytest.raises(DataError, match=r"l\.parquet: record 1: 'text' is a list \(\[1, 2\]\)"):
        load_corpus(tmp_path / "l.parquet")
    with pytest.raises(DataError, match="record 1: 'n' is a number"):
        load_corpus(tmp_path / "n.parquet", text_column="n")
    with pytest.raises(DataError, match="its 2 records are all empty or null"):
        load_corpus(tmp_path / "null.parquet")
    assert len(load_corpus(tmp_path / "n.parquet").doc_starts) == 4  # a null record is an empty document


# ---------------------------------------------------------------------------- class 5: token stores
@pytest.fixture
def stores(world):
    """The bytes store (uint8) and the BPE store (uint16) of the world's corpus, restored after."""
    found = {}
    for tok in ("bytes", str(world["bpe"])):
        c = load_corpus(world["text"], tok)
        found[tok if tok == "bytes" else "bpe"] = c
    dirs = {k: token_store.store_dir(resolve(world["text"]), c.tokenizer) for k, c in found.items()}
    saved = {k: {p: p.read_bytes() for p in d.iterdir()} for k, d in dirs.items()}
    yield dirs
    for k, d in dirs.items():
        for p in d.iterdir():
            if p not in saved[k]:
                p.unlink()
        for p, b in saved[k].items():
            p.write_bytes(b)


def _zero(path, n=64):
    b = bytearray(path.read_bytes())
    m = len(b) // 2
    b[m: m + n] = bytes(n)
    path.write_bytes(bytes(b))


def _legacy(d):
    """The store as the previous release wrote it: no digests."""
    m = json.loads((d / "manifest.json").read_text())
    m["format"] = "phaseloop.tokens.v1"
    m.pop("docs_sha256")
    for sh in m["shards"]:
        sh.pop("sha256")
    (d / "manifest.json").write_text(json.dumps(m))
    (d / token_store.VERIFIED).unlink(missing_ok=True)


def _edit_manifest(d, **keys):
    """The store's manifest with ``keys`` set (None: removed)."""
    m = json.loads((d / "manifest.json").read_text())
    for k, v in keys.items():
        m.pop(k) if v is None else m.__setitem__(k, v)
    (d / "manifest.json").write_text(json.dumps(m))


STORE_CASES = [
    ("bytes", lambda d: _zero(d / "tokens-00000.bin"), ["train", *TINY, "--data", "{text}", "--out", "{root}/x"],
     "tokens-00000.bin differs from the file written"),
    ("bpe", lambda d: _zero(d / "tokens-00000.bin"),
     ["train", *TINY, "--data", "{text}", "--tokenizer", "{bpe}", "--out", "{root}/x"], "its sha256 does not match"),
    ("bpe", lambda d: (d / "tokens-00000.bin").write_bytes(b"\xff\xff" + (d / "tokens-00000.bin").read_bytes()[2:]),
     ["tokenizer", "stats", "-t", "{bpe}", "--data", "{text}", "--quiet"], "tokens-00000.bin differs"),
    ("bytes", lambda d: _zero(d / "docs.i64", 8), ["eval", "{run}"], "docs.i64 differs from the file written"),
    ("bytes", lambda d: _zero(d / "tokens-00000.bin"), ["eval", "{run}"], "and run again to rebuild it"),
    ("bytes", lambda d: (d / "tokens-00000.bin").write_bytes((d / "tokens-00000.bin").read_bytes()[:-5]),
     ["train", *TINY, "--data", "{text}", "--out", "{root}/x"], "its manifest says"),
    ("bytes", lambda d: (d / "manifest.json").write_text("{"), ["eval", "{run}"], "is damaged (JSONDecodeError)"),
    ("bytes", lambda d: _edit_manifest(d, documents=None), ["eval", "{run}"], "is damaged (KeyError)"),
    ("bytes", lambda d: _edit_manifest(d, bytes=0), ["eval", "{run}"], "its manifest's bytes is 0"),
    ("bytes", lambda d: _edit_manifest(d, shards=[]), ["eval", "{run}"], "its manifest lists no shards"),
    ("bytes", lambda d: _edit_manifest(d, tokens=5), ["eval", "{run}"], "its manifest says 5 tokens, its shards hold"),
    ("bytes", lambda d: _edit_manifest(d, format="phaseloop.tokens.v9"), ["eval", "{run}"],
     "its manifest's format is 'phaseloop.tokens.v9'"),
    ("bytes", lambda d: _edit_manifest(d, shards=[{k: v for k, v in sh.items() if k != "sha256"} for sh in
                                                  json.loads((d / "manifest.json").read_text())["shards"]]),
     ["eval", "{run}"], "a shard of its manifest has no sha256"),  # not taken for a store of v1
    ("bytes", lambda d: (d / "manifest.json").unlink(), ["train", *TINY, "--data", "{text}", "--out", "{root}/x"],
     "is damaged (FileNotFoundError)"),  # never taken for a store not built yet
    ("bpe", lambda d: (_legacy(d), (d / "tokens-00000.bin").write_bytes(
        b"\xff\xff" + (d / "tokens-00000.bin").read_bytes()[2:])),
     ["train", *TINY, "--data", "{text}", "--tokenizer", "{bpe}", "--out", "{root}/x"],
     "id 65535 is beyond the tokenizer's vocabulary of"),
]


@pytest.mark.parametrize("which,damage,argv,pattern", STORE_CASES)
def test_damaged_store_is_refused_by_name_never_used_or_rebuilt(world, stores, capsys, which, damage, argv,
                                                                 pattern):
    d = stores[which]
    damage(d)
    line = refused(fill(argv, world), capsys, pattern, world["root"], d)
    assert f"delete the folder {d} " in line  # how to rebuild it


def test_store_verification_is_cached_by_file_state_and_sees_later_damage(world, stores, monkeypatch):
    d = stores["bytes"]
    calls = []  # what was hashed: the document index by file, each shard through its memmap
    real_file, real_shard = token_store.sha256_file, token_store._digest_and_max
    monkeypatch.setattr(token_store, "sha256_file", lambda p: calls.append(p.name) or real_file(p))
    monkeypatch.setattr(token_store, "_digest_and_max",
                        lambda a, digest: calls.append(getattr(a, "filename", None)) or real_shard(a, digest))
    load_corpus(world["text"])  # verified.json matches: a stat per file, no hashing
    assert calls == []
    _zero(d / "tokens-00000.bin")  # written after the stamp: the ctime moves, the check comes back
    with pytest.raises(DataError, match="tokens-00000.bin differs from the file written"):
        load_corpus(world["text"])
    assert any(str(c).endswith("tokens-00000.bin") for c in calls) and "docs.i64" in calls


def test_a_verified_stamp_of_another_shape_is_no_stamp(world, stores):
    d = stores["bytes"]
    load_corpus(world["text"])
    for bad in ("9", [1], 2.5):
        stamp = json.loads((d / token_store.VERIFIED).read_text())
        (d / token_store.VERIFIED).write_text(json.dumps({**stamp, "max_id": bad}))
        assert len(load_corpus(world["text"]).tokens) > 0  # checked in full again, and stamped anew
        assert type(json.loads((d / token_store.VERIFIED).read_text())["max_id"]) is int


def test_store_of_the_previous_release_opens_after_its_checks(world, stores):
    d = stores["bpe"]
    _legacy(d)
    c = load_corpus(world["text"], str(world["bpe"]))
    assert int(np.asarray(c.tokens).max()) < c.tokenizer.vocab_size
    assert json.loads((d / token_store.VERIFIED).read_text())["max_id"] < c.tokenizer.vocab_size
    assert "sha256" not in json.loads((d / "manifest.json").read_text())["shards"][0]  # never rewritten


def test_new_stores_carry_digests(world, stores):
    m = json.loads((stores["bytes"] / "manifest.json").read_text())
    assert m["format"] == token_store.FORMAT and len(m["docs_sha256"]) == 64
    assert all(len(sh["sha256"]) == 64 for sh in m["shards"])


# ---------------------------------------------------------------------------- class 9: messages
MESSAGES = [
    (["train", *TINY, "--data", "{text}", "--text-column", "body", "--out", "{root}/x"],
     "--text-column body does not apply to data"),
    (["train", *TINY, "--data", "{text}", "--data-split", "test", "--out", "{root}/x"],
     "--data-split test does not apply"),
    (["train", *TINY, "--data", "{text}", "--streaming", "--out", "{root}/x"], "--streaming does not apply"),
    (["train", *TINY, "--data", "{root}/list.jsonl", "--data-split", "test", "--out", "{root}/x"],
     "(a file of records)"),
    (["tokenizer", "stats", "--data", "{text}", "--text-column", "body"], "drop it"),
    (["tokenizer", "train", "--data", "shakespeare", "--data-split", "valid", "--kind", "bpe",
      "--vocab-size", "300", "--out", "{root}/x"], "(a built-in source)"),
    (["train", *TINY, "--data", "{root}/fifo", "--out", "{root}/x"], "is a FIFO (named pipe)"),
    (["tokenizer", "stats", "--data", "{root}/fifo"], "save its text to a file"),
    (["train", *TINY, "--data", "{text}", "--tokenizer", "{root}/emptyv", "--out", "{root}/x"],
     "has an empty vocabulary (0 tokens)"),
    (["tokenizer", "stats", "-t", "{root}/nocover", "--data", "{root}/ws.txt"], "holds only whitespace"),
    (["train", *TINY, "--data", "{text}", "--tokenizer", "{root}/nocover", "--out", "{root}/x"],
     "nocover/tokenizer.json encoded the 54030 bytes of data"),
    (["compare", "{root}/r.toml", "--dry-run"], "is not UTF-8 (byte 0xe9 on line 1); save it as UTF-8"),
]


@pytest.mark.parametrize("argv,pattern", MESSAGES)
def test_messages_name_the_problem_and_the_fix(world, capsys, argv, pattern):
    refused(fill(argv, world), capsys, pattern, world["root"], Path(os.environ["PHASELOOP_CACHE"]))


def test_default_data_options_pass_on_any_source(world):
    """A run's config.json (and --print-config) name text_column/split whatever the source."""
    assert resolve(world["text"], "text", "train").kind == "files"
    assert resolve(world["text"], None, None).kind == "files"
    # a run trained when such options were ignored reads its data again (eval, generate, ...)
    assert resolve(world["text"], "body", "test", True, strict=False).kind == "files"
    with pytest.raises(DataError, match="--text-column body and --data-split test and --streaming do not apply"):
        resolve(world["text"], "body", "test", True)


def test_task_file_messages(tmp_path, capsys):
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"input": "", "target": ""}) + "\n")
    refused(["task", "--task", f"jsonl:{empty}", "--steps", "1", "--out", tmp_path / "t", "--quiet"], capsys,
            f"{empty}:1: every 'input' and 'target' is an empty string", tmp_path)
    babi = tmp_path / "babi"
    babi.mkdir()
    (babi / "qa1_single-supporting-fact_train.txt").write_text("1 Mary went home.\n2 Where is Mary?\thome\t1\n")
    line = refused(["babi", "--data-dir", babi, "--tasks", "1", "--steps", "1", "--out", tmp_path / "b",
                    "--quiet"], capsys, "no bAbI file qa1_*_test.txt", tmp_path)
    assert "pass --data-dir" in line


def test_truncated_quantised_file_names_the_fix(tmp_path):
    import torch
    from safetensors.torch import save_file

    from phaseloop.quant.io import load_quantized_state_dict

    f = tmp_path / "quant-w8.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(f))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"is damaged or not a safetensors file .*run `phaseloop quantize`"):
        load_quantized_state_dict(f)


def test_export_writes_the_documented_modes(world, tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert main(["export", str(world["run"]), "--out", str(out)]) == 0
    assert out.stat().st_mode & 0o777 == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert modes and set(modes.values()) == {0o644}, modes


def test_dataset_rows_that_are_not_text(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["fine"] * 3, "n": [1, 2, 3]}).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"row 1: 'n' is a number \(1\), not text"):
        load_corpus(tmp_path / "ds", text_column="n")
    datasets.Dataset.from_dict({"text": ["", None, "  "]}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(DataError, match="holds only whitespace"):
        load_corpus(tmp_path / "empty")


def test_a_build_in_progress_is_not_taken_for_an_interrupted_one(tmp_path):
    """Two processes building the same store: a build folder of a live process (this
    host's) or of another host's recent one is left alone; a dead process's is removed."""
    import os
    import socket
    import subprocess

    from phaseloop.data.store import _abandoned

    host, prefix = socket.gethostname(), ".s.tmp-"
    dead = subprocess.Popen(["true"])
    dead.wait()
    cases = {f"{os.getpid()}@{host}~x": False, f"{dead.pid}@{host}~y": True, f"{os.getpid()}@elsewhere~z": False}
    for name, gone in cases.items():
        (tmp_path / (prefix + name)).mkdir()
        assert _abandoned(tmp_path / (prefix + name), prefix) is gone, name
    old = tmp_path / (prefix + "1@elsewhere~w")
    old.mkdir()
    os.utime(old, (0, 0))  # another host's, untouched for more than a day
    assert _abandoned(old, prefix)


def test_data_split_on_a_dataset_saved_without_splits_is_refused(world, capsys):
    datasets = pytest.importorskip("datasets")
    folder = world["root"] / "dsone"
    if not folder.exists():
        datasets.Dataset.from_dict({"text": ["ok text here " * 20] * 30}).save_to_disk(str(folder))
        capsys.readouterr()  # the library's progress bar
    refused(fill(["tokenizer", "stats", "--data", "{root}/dsone", "--data-split", "test"], world), capsys,
            "is one dataset, saved without splits; --data-split test does not apply to it", world["root"])
    from phaseloop.data.sources import resolve

    assert resolve(str(folder), split="test", strict=False).kind == "hf"  # a run trained so is still read
