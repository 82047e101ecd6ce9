"""An out-of-tree architecture (examples/phaseloop-parallel), pip-installed as a package
with a ``phaseloop.architectures`` entry point: every command takes it, and the generic
tests (causality, cache = full pass, HF equality, config round trips) pick it up with no
list to edit. Without it installed, naming it is a one-line error."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import REPO, write_corpus

PLUGIN = REPO / "examples" / "phaseloop-parallel"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The environment of a user who ran `pip install phaseloop-parallel` (into a folder)."""
    src = tmp_path_factory.mktemp("plugin-src") / "phaseloop-parallel"
    shutil.copytree(PLUGIN, src)  # pip builds in the source folder: keep the repository clean
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--disable-pip-version-check", "--target", str(site),
                    str(src)], check=True, capture_output=True)
    assert list(site.glob("phaseloop_parallel-*.dist-info/entry_points.txt"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
            "PYTHONUNBUFFERED": "1"}


def phaseloop(env, *args, cwd=None):
    return subprocess.run([sys.executable, "-m", "phaseloop", *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def python(env, code: str):
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


TRAIN = ["--steps", "4", "--batch-size", "2", "--eval-every", "2", "--eval-windows", "2",
         "--warmup", "1", "--quiet"]


def test_every_command_takes_the_plugin(env, tmp_path, data_dir):
    corpus = write_corpus(tmp_path / "corpus.txt")
    run = tmp_path / "run"
    r = phaseloop(env, "train", "--arch", "parallel", "--set", "sequential_layers=1", "--set", "d_model=64",
                  "--data", corpus, "--out", run, *TRAIN)
    assert r.returncode == 0, r.stderr
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"]["arch"] == "parallel" and saved["model"]["sequential_layers"] == 1
    assert saved["software"]["arch_plugin"].startswith("phaseloop-parallel ")  # the package of its entry point
    saved = saved["model"]
    r = phaseloop(env, "eval", run, "--json", "--windows", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["val_loss"] > 0
    r = phaseloop(env, "generate", run, "--prompt", "the", "--max-new-tokens", "5", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("the"), r.stderr
    r = phaseloop(env, "archs", "--json")
    listed = {row["arch"]: row for row in json.loads(r.stdout)}
    assert listed["parallel"]["options"] == {"ParallelOptions": ["sequential_layers"]} | {
        k: v for k, v in listed["rope"]["options"].items()}  # its own group beside the composable ones
    assert listed["parallel"]["presets"] == ["parallel-tiny", "parallel-small"]
    r = phaseloop(env, "params", "--preset", "parallel-small", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["arch"] == "parallel", r.stderr
    # compare: the arch and its alias in a recipe, at the plugin's own "-tiny" presets
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "p"\ndata = "{corpus}"\nscale = "tiny"\nseeds = [0]\n'
                      'variants = ["rope", "gptj", "parallel sequential_layers=1"]\n'
                      "[train]\nsteps = 2\nbatch_size = 2\nseq_len = 16\neval_every = 2\neval_windows = 1\n"
                      "warmup_steps = 1\n")
    r = phaseloop(env, "compare", recipe, "--out", tmp_path / "cmp", "--quiet")
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "cmp" / "summary.json").read_text())["variants"]
    assert [v["model"]["arch"] for v in rows] == ["rope", "parallel", "parallel"]
    # export, then transformers loads it (remote code) and its logits equal phaseloop's
    r = phaseloop(env, "export", run, "--out", tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    r = python(env, f"""
import torch, phaseloop
from transformers import AutoModelForCausalLM
from phaseloop.engine.checkpoint import load_run
hf = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'hf')!r}, trust_remote_code=True).eval()
ours, _ = load_run({str(run)!r}, torch.device('cpu'))
idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
print((hf(idx).logits - ours.eval()(idx).logits).abs().max().item())
""")
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[-1]) <= 1e-6  # the tolerance docs/hf.md states for fp32
    r = phaseloop(env, "lm-eval", run, "--tasks", "wikitext2_local", "--limit", "2", "--batch-size", "2",
                  "--data-dir", data_dir)
    assert r.returncode == 0, r.stderr
    res = json.loads((run / "lm_eval" / "results.json").read_text())["results"]["wikitext2_local"]
    assert 0 < res["bits_per_byte,none"] < 10
    # where the plugin is not installed: the run is named as fine, the package to install named
    r = phaseloop({**os.environ}, "eval", run)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "this run's model is arch 'parallel'" in r.stderr and "phaseloop-parallel " in r.stderr, r.stderr
    assert "restore" not in r.stderr and r.stderr.strip().endswith("run this again"), r.stderr


def test_generic_tests_pick_up_the_plugin(env):
    """The same test files, run where the plugin is installed, test it too."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                        "tests/test_model.py", "tests/test_config.py", "tests/test_hf.py",
                        "tests/test_hf_common.py", "-k", "parallel"], env=env, cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    passed = set(re.findall(r"^PASSED (\S+)", r.stdout, re.M))
    for test in ("test_model.py::test_causal_no_future_leak[arch=parallel]",
                 "test_model.py::test_kv_cache_equals_full_forward[arch=parallel]",
                 "test_model.py::test_kv_cache_equals_full_forward[parallel-tiny]",
                 "test_model.py::test_cached_generation_equals_uncached[arch=parallel]",
                 "test_config.py::test_every_registered_arch_builds_from_its_defaults[parallel]",
                 "test_hf.py::test_logits_equal_fp32_and_bf16[arch=parallel]",
                 "test_hf.py::test_generate_greedy_cache_and_no_cache_equal_phaseloop[arch=parallel]"):
        assert f"tests/{test}" in passed, (test, sorted(passed))
    sys.path.insert(0, str(REPO / "tests" / "hf_common"))
    import fetch  # transformers' common tests and the generation contract, where fetched

    if (fetch.package_dir() / "test_modeling_common.py").is_file():
        for test in ("test_save_load", "test_left_padding_compatibility",
                     "test_generate_continue_from_past_key_values"):
            assert f"tests/test_hf_common.py::TestHFCommon_parallel::{test}" in passed, (test, sorted(passed))


def test_without_the_plugin_naming_it_is_one_line(tmp_path):
    plain = {**os.environ}
    r = phaseloop(plain, "train", "--preset", "parallel-tiny", "--out", tmp_path / "x", *TRAIN)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown preset 'parallel-tiny'" in r.stderr
    r = phaseloop(plain, "train", "--arch", "parallel", "--out", tmp_path / "y", *TRAIN)
    assert r.returncode == 2 and "arch='parallel': unknown architecture" in r.stderr, r.stderr
    assert "phaseloop.architectures" in r.stderr and not (tmp_path / "y").exists()


def test_a_broken_plugin_is_named(tmp_path):
    """An installed plugin that fails to import is one line naming it, not a traceback."""
    site = tmp_path / "site"
    (site / "broken_arch-0.1.dist-info").mkdir(parents=True)
    (site / "broken_arch-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: broken-arch\nVersion: 0.1\n")
    (site / "broken_arch-0.1.dist-info" / "entry_points.txt").write_text(
        "[phaseloop.architectures]\nbroken = broken_arch\n")
    (site / "broken_arch.py").write_text("raise ImportError('needs torch 9')\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = phaseloop(env, "train", "--set", "arch=nope", "--out", tmp_path / "x", *TRAIN)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "plugin 'broken'" in r.stderr and "needs torch 9" in r.stderr


def test_a_run_or_export_without_its_plugin_says_what_to_install(tmp_path, capsys, monkeypatch):
    """Issue 38, item 12: the run's files are fine, so no "restore it"; the architecture
    and the package that registered it (recorded in config.json and in the export) are
    named in full, never cut mid-word; an export loaded through transformers raises one
    ConfigError with the same advice and no chained traceback. In process, with a copy of
    rope registered as arch 'gone' by a (pretend) package, then unregistered."""
    import dataclasses

    from conftest import TINY, snapshot

    from phaseloop import registry
    from phaseloop.cli import main
    from phaseloop.errors import ConfigError

    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    spec = dataclasses.replace(registry.get_arch("rope"), name="gone", presets={}, default=False, aliases=(),
                               preset_prefixes=(), default_preset=None)
    monkeypatch.setitem(registry.ARCHS, "gone", spec)
    monkeypatch.setitem(registry.PROVIDERS, "gone", "phaseloop-gone 1.2")
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["train", *TINY, "--set", "arch=gone", "--steps", "2", "--eval-every", "2",
                 "--data", str(write_corpus(tmp_path / "c.txt")), "--out", str(run)]) == 0
    assert main(["export", str(run), "--out", str(hf)]) == 0
    assert json.loads((run / "config.json").read_text())["software"]["arch_plugin"] == "phaseloop-gone 1.2"
    monkeypatch.delitem(registry.ARCHS, "gone")  # the plugin uninstalled
    before = snapshot(tmp_path)
    capsys.readouterr()
    for argv in (["eval", run], ["generate", run, "--prompt", "a"], ["export", run, "--out", tmp_path / "hf2"]):
        code = main([str(a) for a in argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert err == (f"phaseloop: error: {run}/config.json: this run's model is arch 'gone', which no package "
                       "installed here registers; install the plugin that provides arch 'gone' (the package that "
                       "registered it where it was made: phaseloop-gone 1.2) where phaseloop runs, then run this "
                       "again"), err
    assert snapshot(tmp_path) == before
    with pytest.raises(ConfigError) as e:
        AutoModelForCausalLM.from_pretrained(hf, trust_remote_code=True)
    assert str(e.value) == ("this Hugging Face folder holds a phaseloop model of arch 'gone', which no package "
                            "installed here registers; install the plugin that provides arch 'gone' (the package "
                            "that registered it where it was made: phaseloop-gone 1.2) where phaseloop runs, then "
                            "load the folder again")
    assert e.value.__cause__ is None and e.value.__suppress_context__  # raised from None: no chained traceback


def test_messages_are_never_cut_inside_a_word():
    from phaseloop.errors import first_line

    text = "a plugin registers through the entry-point group 'phaseloop.architectures': pip install it"
    assert first_line(text) == text  # not cut
    for limit in range(10, len(text)):
        cut = first_line(text, limit)
        assert cut.endswith(" …") and text.startswith(cut[:-2]) and len(cut) <= limit + 2
        assert text[len(cut) - 2] in " ,;:("  # ends where a word ended
    assert first_line(ValueError("")) == "ValueError" and first_line(ValueError("one\ntwo")) == "one"


def _site(tmp_path, plugins: dict[str, tuple[str, str]]):
    """A folder of fake installed plugins: name -> (entry point value, module source)."""
    site = tmp_path / "site"
    for name, (value, source) in plugins.items():
        info = site / f"{name}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[phaseloop.architectures]\n{name} = {value}\n")
        (site / f"{value.split(':')[0]}.py").write_text(source)
    return {**os.environ, "PYTHONPATH": str(site)}


FUNCTION_PLUGIN = """
from phaseloop import registry
from phaseloop.model import Stack

def register():
    registry.register_arch(registry.ArchSpec(name="fnarch", trunk=Stack, commands=COMMANDS))
COMMANDS = None
"""


def test_a_plugin_that_fails_is_named_and_never_a_healthy_one(tmp_path):
    """A commands hook that raises (or adds a command phaseloop has) is one line naming the
    plugin; after another plugin failed to load, asking again names that one, not a
    function entry point that loaded already."""
    bad_hook = FUNCTION_PLUGIN.replace("COMMANDS = None", "COMMANDS = 'fn_plugin:nowhere'")
    r = phaseloop(_site(tmp_path / "a", {"fn": ("fn_plugin:register", bad_hook)}), "params")
    assert r.returncode == 2 and r.stderr.count("\n") <= 1 and "providing 'fnarch' failed to add its commands" \
        in r.stderr, r.stderr
    clash = FUNCTION_PLUGIN.replace("COMMANDS = None", "COMMANDS = 'fn_plugin:add'\n"
                                    "def add(sub):\n    sub.add_parser('train')")
    r = phaseloop(_site(tmp_path / "b", {"fn": ("fn_plugin:register", clash)}), "params")
    assert r.returncode == 2 and "conflicting subparser: train" in r.stderr, r.stderr
    env = _site(tmp_path / "c", {"fn": ("fn_plugin:register", FUNCTION_PLUGIN),
                                 "zbroken": ("zbroken_arch", "raise ImportError('needs torch 9')\n")})
    code = ("from phaseloop import registry\nfor _ in range(2):\n    try:\n        registry.get_arch('nope')\n"
            "    except Exception as e:\n        print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2 and all("plugin 'zbroken'" in line for line in lines), r.stdout + r.stderr


def test_a_plugin_not_installed_is_said_before_its_keys(tmp_path, capsys):
    from conftest import run_cli

    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\narch = "sandwich"\nsandwich_every = 2\n')
    code, err = run_cli(["train", "--config", cfg, "--print-config"], capsys)
    assert code == 2 and "arch='sandwich': unknown architecture" in err, err
    from phaseloop.compare import Recipe, RecipeError

    with pytest.raises(RecipeError, match="variant 's': invalid config: arch='sandwich': unknown architecture"):
        Recipe.from_dict({"variants": [{"name": "s", "spec": "sandwich sandwich_every=2"}]})


def test_info_commands_into_a_closed_pipe_end_quietly():
    r = subprocess.run(f"{sys.executable} -m phaseloop params --all | head -1", shell=True, capture_output=True,
                       text=True, timeout=120)
    assert r.stdout.startswith("preset") and r.stderr == "", r.stderr
