"""What `phaseloop serve` serves: served greedy text equals `phaseloop generate` for every
architecture, requests in flight together (UT+ACT and the other trunks alike), with a
depth and an exit rule chosen per request equal to `generate --depth` / `--exit`; an
exported folder serves as its run does; `--quantized` on an export serves the dequantised
weights (on a run it serves them packed: tests/test_serve_adaptive.py); chat completions
through a chat template (and a 400 without one)."""

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")

from conftest import assert_one_line, run_cli  # noqa: E402
from serve_fixtures import fake_run  # noqa: E402

from phaseloop import PRESETS, CheckpointError  # noqa: E402
from phaseloop.cli import main  # noqa: E402
from phaseloop.early_exit import parse_exit  # noqa: E402
from phaseloop.engine.checkpoint import load_run  # noqa: E402
from phaseloop.quant.io import load_quantized_state_dict  # noqa: E402
from phaseloop.serve.loading import load  # noqa: E402
from phaseloop.serve.options import Settings  # noqa: E402
from phaseloop.serve.runner import Background, Config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = sorted(p for p in PRESETS if p.endswith("-tiny"))
PROMPTS = ["the quick", "over the lazy dog. the", "j"]
# per-request options each weight-tied preset takes, as `generate` flags and as the body field
OPTIONS = {"looped-tiny": [(["--depth", "3"], {"depth": 3}), (["--exit", "kl:1e-2"], {"exit": "kl:1e-2"})],
           "universal-tiny": [(["--depth", "2"], {"depth": 2}), (["--exit", "argmax:1"], {"exit": "argmax:1"})],
           "universal-act-tiny": [(["--exit", "act:0.5"], {"exit": "act:0.5"})],
           "hyperloop-tiny": [(["--depth", "3", "--extend-loops", "last"], {"depth": 3, "extend_loops": "last"})]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("archs")
    return {p: fake_run(root, p) for p in TINY}


def generated(capsys, run, prompt, *flags) -> str:
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12",
                 *flags]) == 0
    return capsys.readouterr().out[:-1][len(prompt):]


def complete(bg, prompt, options=None, max_tokens=12) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **({"phaseloop": options} if options else {})}
    r = httpx.post(f"{bg.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("preset", TINY)
def test_served_greedy_equals_generate_for_every_architecture(runs, preset, capsys):
    run = runs[preset]
    jobs = [(p, [], None) for p in PROMPTS] + [(p, flags, body) for flags, body in OPTIONS.get(preset, [])
                                               for p in PROMPTS[:2]]
    want = [generated(capsys, run, p, *flags) for p, flags, _ in jobs]
    with Background(load(run), Config(port=0, max_batch=8)) as bg:
        with ThreadPoolExecutor(len(jobs)) as pool:  # in flight together: batched, grouped by settings
            got = list(pool.map(lambda job: complete(bg, job[0], job[2]), jobs))
    assert got == want


def test_export_serves_as_its_run(runs, tmp_path):
    pytest.importorskip("transformers")
    run = runs["looped-tiny"]
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out), "--depth", "3"]) == 0
    with Background(load(run), Config(port=0)) as a, Background(load(out), Config(port=0)) as b:
        card = httpx.get(f"{b.url}/v1/models").json()["data"][0]
        assert card["id"] == "exported" and card["phaseloop"]["kind"] == "export"
        assert card["phaseloop"]["defaults"] == {"depth": 3}  # the export's own depth
        ran = httpx.get(f"{a.url}/v1/models").json()["data"][0]["phaseloop"]  # depth: passes, as a request's
        assert card["phaseloop"]["depth"] == 3 and ran["depth"] == load_run(run)[0].trunk.passes != ran["layers"]
        # "depth": null is the trained depth, first and after requests at other depths (it was the
        # export's depth until a request with a depth reset the model)
        trained = [complete(a, p) for p in PROMPTS[:2]]
        assert [complete(b, p, {"depth": None}) for p in PROMPTS[:2]] == trained
        for p in PROMPTS:
            assert complete(b, p) == complete(a, p, {"depth": 3})
            assert complete(b, p, {"depth": 2}) == complete(a, p, {"depth": 2})
        assert [complete(b, p, {"depth": None}) for p in PROMPTS[:2]] == trained
    # --exit over an export keeps the export's depth (it ran at the trained depth, advertising 3)
    with Background(load(run), Config(port=0)) as a, \
            Background(load(out, defaults=Settings(exit=parse_exit("argmax:1")[0])), Config(port=0)) as b:
        card = httpx.get(f"{b.url}/v1/models").json()["data"][0]["phaseloop"]
        assert card["defaults"] == {"depth": 3, "exit": "argmax:1"} and card["depth"] == 3
        for p in PROMPTS[:2]:
            assert complete(b, p) == complete(a, p, {"depth": 3, "exit": "argmax:1"})


def test_quantized_export_serves_the_dequantised_weights(runs, text_file, tmp_path):
    pytest.importorskip("transformers")
    run = runs["rope-tiny"]
    assert main(["quantize", str(run), "--bits", "4", "--group-size", "32", "--windows", "2", "--data",
                 str(text_file)]) == 0
    qfile = run / "quant-w4-g32-rtn.safetensors"
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    model, _ = load_run(run)
    load_quantized_state_dict(qfile, model)
    with Background(load(tmp_path / "exported", quantized=str(qfile)), Config(port=0)) as bg:
        card = httpx.get(f"{bg.url}/v1/models").json()["data"][0]["phaseloop"]
        assert card["quantized"]["file"] == qfile.name and not card["quantized"]["packed"]
        for p in PROMPTS:
            ids = torch.tensor([list(p.encode())])
            want = bytes(model.generate(ids, 12, temperature=0)[0, ids.shape[1]:].tolist()).decode("utf-8", "replace")
            assert complete(bg, p) == want
    other = next(r for p, r in runs.items() if p != "rope-tiny")
    assert main(["quantize", str(other), "--bits", "8", "--windows", "2", "--data", str(text_file)]) == 0
    for bad, pattern in ((run / "checkpoint" / "model.safetensors", "not a phaseloop quantised file"),
                         (next(other.glob("quant-w8-*.safetensors")), "quantised from another model")):
        with pytest.raises(CheckpointError, match=pattern):  # a file of another model, or none
            load(tmp_path / "exported", quantized=str(bad))
    record = tmp_path / "exported" / "phaseloop.json"  # an export of another checkpoint of this model
    record.write_text(json.dumps({**json.loads(record.read_text()), "checkpoint_sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match="quantised from another checkpoint"):
        load(tmp_path / "exported", quantized=str(qfile))


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_chat_completions_through_a_chat_template(runs, tmp_path):
    pytest.importorskip("transformers")
    run = runs["rope-tiny"]
    (tmp_path / "chat.jinja").write_text(TEMPLATE + "{% if messages|length > 3 %}{{ raise_exception('too long') }}"
                                         "{% endif %}")
    with Background(load(run, chat_template=str(tmp_path / "chat.jinja")), Config(port=0)) as bg:
        client = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick"}]
        got = client.chat.completions.create(model=run.name, messages=msgs, max_tokens=12, temperature=0)
        want = complete(bg, "system: be brief\nuser: the quick\nassistant:")
        assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
        parts = list(client.chat.completions.create(model=run.name, messages=msgs, max_tokens=12, temperature=0,
                                                    stream=True))
        assert parts[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in parts) == want
        lp = client.chat.completions.create(model=run.name, messages=msgs, max_tokens=3, temperature=0,
                                            logprobs=True, top_logprobs=2).choices[0].logprobs.content
        assert len(lp) == 3 and all(len(t.top_logprobs) == 2 and t.logprob == t.top_logprobs[0].logprob for t in lp)
        with pytest.raises(openai.BadRequestError, match="too long"):
            client.chat.completions.create(model=run.name, messages=msgs * 2, max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="role"):
            client.chat.completions.create(model=run.name, messages=[{"role": "robot", "content": "x"}])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_or_foreign_folder_is_refused_by_name(runs, tmp_path, capsys):
    """serve checks an export against the digests its phaseloop.json records (weights,
    config, tokenizer): a damaged file is named, never served and never taken for a missing
    one; a Llama export and a file given for a folder are each one line saying what they are."""
    pytest.importorskip("transformers")
    run = runs["rope-tiny"]
    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    record = json.loads((out / "phaseloop.json").read_text())
    assert set(record["files"]) == {"model.safetensors", "config.json", "tokenizer.json"}
    old_style = {k: v for k, v in record.items() if k != "files"}  # an export from before the digests
    cases = [
        (lambda d: (d / "config.json").write_text("{"), "config.json: JSONDecodeError; the file is damaged"),
        (lambda d: _flip(d / "model.safetensors"), "has changed since `phaseloop export` wrote it (damaged, or "
                                                   "saved again): model.safetensors differs from the file written"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda d: (d / "phaseloop.json").write_text("["), "phaseloop.json: JSONDecodeError; the file is damaged "
                                                           "— export the run again"),
        (lambda d: (d / "phaseloop.json").write_text(json.dumps({**record, "files": 3})),
         "its phaseloop.json holds no file digests"),
        (lambda d: ((d / "phaseloop.json").write_text(json.dumps(old_style)),
                    (d / "tokenizer.json").write_text('{"x": 1}')), "tokenizer.json cannot be loaded"),
        (lambda d: (d / "tokenizer_config.json").write_text('{"cut'), "tokenizer_config.json cannot be loaded"),
        (lambda d: ((d / "phaseloop.json").unlink(), (d / "model.safetensors").write_bytes(
            (d / "model.safetensors").read_bytes()[:100])), "model.safetensors is damaged"),  # no digests to check
    ]
    for i, (damage, pattern) in enumerate(cases):
        copy = tmp_path / f"d{i}"
        shutil.copytree(out, copy)
        damage(copy)
        with pytest.raises(CheckpointError, match=re.escape(pattern)):
            load(copy)
        code, err = run_cli(["serve", copy, "--port", "0"], capsys)
        assert_one_line(code, err, pattern)
    shutil.copytree(out, tmp_path / "fine")
    (tmp_path / "fine" / "phaseloop.json").write_text(json.dumps(old_style))
    assert load(tmp_path / "fine").info["kind"] == "export"  # nothing recorded: nothing to check
    (tmp_path / "fine" / "phaseloop.json").unlink()  # save_pretrained's folder has none: served as it is
    assert load(tmp_path / "fine").info["kind"] == "export"
    assert main(["export", str(run), "--format", "llama", "--out", str(tmp_path / "llama")]) == 0
    for path, pattern in ((tmp_path / "llama", "is a 'llama' model folder (phaseloop export --format llama)"),
                          (run / "config.json", "config.json is a file, not a folder")):
        code, err = run_cli(["serve", path, "--port", "0"], capsys)
        assert_one_line(code, err, pattern)
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m.content }\n")
    for template, pattern in ((tmp_path / "bad.jinja", "does not compile (unexpected '}')"),
                              (tmp_path, "is a folder; pass a Jinja chat template file")):
        code, err = run_cli(["serve", run, "--port", "0", "--chat-template", template], capsys)
        assert_one_line(code, err, pattern)
    code, err = run_cli(["serve", run, "--port", "0", "--exit", "kl:0.1", "--exit", "argmax:2"], capsys)
    assert_one_line(code, err, "--exit: given twice")
    # the server's own flags refused in the words `generate` uses (they came out as "--depth: extend-loops ...")
    code, err = run_cli(["serve", runs["hyperloop-tiny"], "--port", "0", "--extend-loops", "last"], capsys)
    assert_one_line(code, err, "--extend-loops applies with --depth; add --depth K")
