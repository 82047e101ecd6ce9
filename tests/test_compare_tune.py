"""`phaseloop compare` with per-variant training settings and [tune] (issue 27): the
tuned choice equals a hand-run grid's, tuning never reads the reported validation split,
the grid grows at its edges, resume and dry-run cover tuning, bad tables are one line."""

import json
import math
from pathlib import Path

import pytest
from conftest import REPO, assert_one_line, run_cli

import phaseloop.lm.train as train_mod
from phaseloop.compare import (
    Recipe,
    RecipeError,
    apply_overrides,
    load_recipe,
    paired_t_test,
    plan_variants,
    run_comparison,
)
from phaseloop.compare.dryrun import dry_run
from phaseloop.compare.tune import choose, grow
from phaseloop.data import store
from phaseloop.engine import TrainConfig
from phaseloop.errors import PhaseloopError

TINY_TRAIN = dict(steps=6, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=1, eval_every=2,
                  eval_windows=2, ckpt_every=2, log_every=1)
pytestmark = pytest.mark.usefixtures("one_thread")


def recipe(data, tune=None, **kw) -> Recipe:
    d = dict(name="t", data=str(data), scale="tiny", seeds=[0], variants=["rope"], train=dict(TINY_TRAIN))
    if tune is not None:
        d["tune"] = {"seeds": [7], **tune}
    return Recipe.from_dict({**d, **kw})


def final_loss(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["val_loss"]


# ---------------------------------------------------------------------------- recipes
@pytest.mark.parametrize("d, msg", [
    (dict(variants=[{"spec": "rope", "train": {"lrr": 1e-3}}]), "unknown key 'lrr' (did you mean 'lr'?)"),
    (dict(variants=[{"spec": "rope", "train": {"steps": 3}}]), "steps is shared by every variant"),
    (dict(variants=[{"spec": "rope", "train": {"lr": -1}}]), "variant 'rope' train: invalid train config: lr=-1"),
    (dict(variants=[{"spec": "rope", "train": 3}]), "train must be a table"),
    (dict(variants=["rope", {"spec": "3pt", "control": "rop"}]), "control='rop' names no other variant"),
    (dict(tune={"lrs": [1, 2]}), "[tune]: unknown key 'lrs' (did you mean 'lr'?)"),
    (dict(tune={"lr": [1e-3]}), "[tune] lr=[0.001]: must be a list of at least 2"),
    (dict(tune={"lr": [1e-3, -1e-3]}), "at least 2 distinct positive rates"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": []}), "[tune] seeds=[]"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [1, 5]}), "[tune] seeds [1] are also reported seeds [0, 1]"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [5], "warmup_steps": [-1]}), "[tune] warmup_steps=[-1]"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [5], "weight_decay": [2.0]}), "[tune] weight_decay=[2.0]"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [5], "extend": 11}), "[tune] extend=11"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [5], "steps": 0}), "[tune] steps=0"),
    # integers past their bounds (issue 38, item 7)
    (dict(train={"steps": 10**20}), "steps=100000000000000000000: at most 2,147,483,647"),
    (dict(variants=[{"spec": "rope", "train": {"warmup_steps": 2**40}}]), "warmup_steps=1099511627776: at most"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [5], "steps": 2**31}), "[tune] steps=2147483648: must be an integer "
                                                                     "from 1 to 2,147,483,647"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [5], "warmup_steps": [2**40]}), "from 0 to 2,147,483,647"),
    (dict(eval_limit=2**40), "eval_limit=1099511627776: at most 2,147,483,647"),
    (dict(tune={"lr": [0.001, 0.0010000001, 2e-3], "seeds": [5]}), "agree to 6 significant digits"),
    (dict(seeds=[2**63]), "integers from 0 to 2^63 - 1"),
    (dict(tune={"lr": [1e-3, 2e-3], "seeds": [5]}, variants=[{"spec": "rope", "train": {"lr": 1e-3}}]),
     "variant 'rope' sets train.lr and [tune] tunes lr"),
])
def test_bad_variant_train_and_tune_tables(d, msg):
    base = dict(name="x", variants=["rope"], seeds=[0, 1], train={"steps": 2})
    with pytest.raises(RecipeError) as ei:
        Recipe.from_dict({**base, **d})
    assert msg in str(ei.value)


def test_bad_tune_table_is_one_line_at_the_cli(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('variants = ["rope"]\nseeds = [0]\n[tune]\nlr = [1e-3, 2e-3]\nseeds = [0]\n')
    code, err = run_cli(["compare", bad, "--out", tmp_path / "o", "--dry-run"], capsys)
    assert_one_line(code, err, "[tune] seeds [0] are also reported seeds [0]")
    assert not (tmp_path / "o").exists()


def test_variant_train_tables_inline_and_keyed(tmp_path):
    """`train = {...}` inline, a [variants.NAME.train] table, and a [[variants]] entry's
    [variants.train]: all the same settings, and budget matching still plans."""
    keyed = tmp_path / "keyed.toml"
    keyed.write_text('seeds = [0]\nscale = "tiny"\nmatch = "params"\n[variants.rope]\n[variants."3pt N=3"]\n'
                     'spec = "three_phase N=3"\n[variants."3pt N=3".train]\nlr = 3e-3\nwarmup_steps = 50\n')
    array = tmp_path / "array.toml"
    array.write_text('seeds = [0]\nscale = "tiny"\nmatch = "params"\n[[variants]]\nspec = "rope"\n'
                     '[[variants]]\nname = "3pt N=3"\nspec = "three_phase N=3"\n[variants.train]\n'
                     'lr = 3e-3\nwarmup_steps = 50\n')
    inline = tmp_path / "inline.toml"
    inline.write_text('seeds = [0]\nscale = "tiny"\nmatch = "params"\nvariants = ["rope", { name = "3pt N=3", '
                      'spec = "three_phase N=3", train = { lr = 3e-3, warmup_steps = 50 } }]\n')
    got = [load_recipe(p).to_dict() for p in (keyed, array, inline)]
    assert got[0]["variants"] == got[1]["variants"] == got[2]["variants"]
    r = load_recipe(inline)
    assert r.train_config(4, r.variants[1]).to_dict() == {**r.train, "seed": 4, "lr": 3e-3, "warmup_steps": 50}
    assert r.train_config(4, r.variants[0]).lr == r.train["lr"]
    plan = plan_variants(r, 256)
    assert plan[1].matched and abs(plan[1].matched["rel_diff"]) <= r.match_tolerance


# ---------------------------------------------------------------------------- the choice
def rows(losses, lrs):
    return [{"point": {"lr": x}, "loss": y} for x, y in zip(lrs, losses)]


def test_choose_and_grow():
    lrs = [1e-3, 2e-3, 4e-3]
    assert choose(rows([3.0, 2.0, 2.5], lrs), lrs, 0, 2) == (rows([2.0], [2e-3])[0], None)
    assert choose(rows([3.0, 2.5, 2.0], lrs), lrs, 0, 2)[1] == "up"
    assert choose(rows([2.0, 2.5, 3.0], lrs), lrs, 1, 2)[1] == "down"
    assert choose(rows([2.0, 2.5, 3.0], lrs), lrs, 2, 2)[1] is None  # extensions spent
    assert choose(rows([2.0, 2.0, 3.0], lrs), lrs, 2, 2)[0]["point"]["lr"] == 1e-3  # ties: the first
    # a diverged (infinite) rate never wins; all diverged: the smallest rate, growing down
    assert choose(rows([2.5, 2.0, math.inf], lrs), lrs, 0, 2) == (rows([2.0], [2e-3])[0], None)
    assert choose(rows([math.inf] * 3, lrs), lrs, 0, 2)[1] == "down"
    assert grow(lrs, "up") == [1e-3, 2e-3, 4e-3, 8e-3]
    assert grow(lrs, "down") == [5e-4, 1e-3, 2e-3, 4e-3]
    assert grow([1e-4, 3e-4], "up") == [1e-4, 3e-4, 9e-4]  # the outer ratio, 4 significant digits


# ---------------------------------------------------------------------------- runs
def test_tuned_choice_equals_a_hand_run_grid(tmp_path, text_file):
    """A tuned comparison picks the rate a grid run by hand through the same engine picks,
    with the same tuning losses: the hand grid trains on a file holding only the training
    portion of the reported split (the validation tail cut off), so tuning saw no more.
    Each variant's own settings and its tuned rate land in its runs' config.json."""
    lrs = [3e-4, 3e-3, 3e-2]
    r = recipe(text_file, {"lr": lrs, "extend": 0}, seeds=[0, 1],
               variants=["rope", {"spec": "three_phase N=3", "train": {"warmup_steps": 2, "beta2": 0.99},
                                  "control": "rope"}])
    out = tmp_path / "cmp"
    s = run_comparison(r, out, progress=False, log=None)

    data = text_file.read_bytes()  # bytes tokenizer, one document: the cut is n - int(0.1 n)
    part = tmp_path / "train_part.txt"
    part.write_bytes(data[: len(data) - int(len(data) * 0.1)])
    plan = {p.name: p for p in plan_variants(r, 256)}
    for v in r.variants:
        hand = {}
        for lr in lrs:
            tc = TrainConfig.from_dict({**r.train, **v.train, "lr": lr, "seed": 7})
            hand[lr] = train_mod.train(plan[v.name].cfg, tc, str(part), tmp_path / "hand" / v.slug / f"{lr:g}",
                                       progress=False)["val_loss"]
        tuned = s["tuning"][v.name]
        assert {row["point"]["lr"]: row["loss"] for row in tuned["points"]} == pytest.approx(hand, abs=1e-6)
        assert tuned["chosen"] == {"lr": min(hand, key=hand.get)}
        cfg = json.loads((out / "runs" / f"{v.slug}-s0" / "config.json").read_text())["train"]
        assert cfg["lr"] == tuned["chosen"]["lr"]
        assert cfg["warmup_steps"] == v.train.get("warmup_steps", 1) and cfg["beta2"] == v.train.get("beta2", 0.95)
    # the vs-control verdict: the paired t-test of the two variants' final losses, read by hand
    finals = {v.slug: [final_loss(out / "runs" / f"{v.slug}-s{seed}") for seed in (0, 1)] for v in r.variants}
    got = next(v for v in s["variants"] if v["name"] == "three_phase N=3")["vs_control"]
    assert got == {"control": "rope", **paired_t_test(finals["rope"], finals["three_phase-N3"])}
    report = (out / "report.md").read_text()
    assert "| vs control |" in report and f"{got['verdict']} (p={got['p']:.3f}) vs rope |" in report
    assert "## Learning-rate tuning" in report and "**chosen**" in report and "beta2 = 0.99" in report
    assert (out / "tuning_loss_vs_lr.png").stat().st_size > 0
    # the per-variant settings are part of what a rerun into the folder checks
    other = Recipe.from_dict({**r.to_dict(), "variants": ["rope", {"spec": "three_phase N=3",
                                                                  "train": {"warmup_steps": 3, "beta2": 0.99}}]})
    with pytest.raises(RecipeError, match=r"different comparison \(variants"):
        run_comparison(other, out, progress=False, log=None)


def test_tuning_never_reads_the_reported_validation_split(tmp_path, text_file, monkeypatch):
    """Every token read (TokenView slices: training windows, evaluation windows) is
    recorded with the run reading it: tuning runs read only before the reported split's
    cut; the reported runs do read past it (the spy sees validation reads)."""
    reads, current = [], [None]
    real_getitem, real_train = store.TokenView.__getitem__, train_mod.train

    def spy(self, key):
        if isinstance(key, slice):
            a, b, _ = key.indices(len(self))
            if b > a:
                reads.append((current[0], self.start + a, self.start + b))
        return real_getitem(self, key)

    def train(model_cfg, tc, data, out_dir, **kw):
        current[0] = Path(out_dir).relative_to(tmp_path / "cmp").parts[0]  # "tune" or "runs"
        return real_train(model_cfg, tc, data, out_dir, **kw)

    monkeypatch.setattr(store.TokenView, "__getitem__", spy)
    monkeypatch.setattr(train_mod, "train", train)
    run_comparison(recipe(text_file, {"lr": [1e-3, 3e-3], "extend": 0}), tmp_path / "cmp", progress=False, log=None)
    n = len(text_file.read_bytes())
    cut = n - int(n * 0.1)
    tuning = [r for r in reads if r[0] == "tune"]
    main = [r for r in reads if r[0] == "runs"]
    assert tuning and main
    assert max(b for _, _, b in tuning) <= cut
    assert any(b > cut for _, _, b in main)  # the spy sees the reported runs read the validation split


def test_edge_extension_and_resume_mid_tuning(tmp_path, text_file, monkeypatch):
    """At 6 steps a larger rate is better, so the best rate sits on the grid's top edge:
    the grid grows 10x twice (extend = 2) and the report says the choice is still on the
    edge. Interrupted in the second extension's run, a rerun resumes that run from its
    checkpoint, redoes no finished run, and goes on to the reported runs."""
    r = recipe(text_file, {"lr": [1e-5, 1e-4], "extend": 2})
    out = tmp_path / "cmp"

    def stop(name, step, rec):
        if name == "tune/rope/lr0.01-s7" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_comparison(r, out, progress=False, log=None, on_step=stop)
    assert sorted(p.name for p in (out / "tune" / "rope").iterdir()) == [
        "lr0.0001-s7", "lr0.001-s7", "lr0.01-s7", "lr1e-05-s7"]
    assert not (out / "runs").exists()
    ckpt = out / "tune" / "rope" / "lr0.01-s7" / "checkpoint" / "trainer.json"
    assert json.loads(ckpt.read_text())["step"] == 2

    calls, real_train = [], train_mod.train
    monkeypatch.setattr(train_mod, "train", lambda *a, **kw: (calls.append(Path(a[3]).name), real_train(*a, **kw))[1])
    s = run_comparison(r, out, progress=False, log=None)
    assert calls == ["lr0.01-s7", "rope-s0"]
    t = s["tuning"]["rope"]
    assert t["lrs"] == [1e-5, 1e-4, 1e-3, 1e-2] and t["extensions"] == 2 and t["on_edge"]
    assert t["chosen"] == {"lr": 1e-2}
    report = (out / "report.md").read_text()
    assert "grid extended 2 of at most 2 times" in report and "still on the grid's edge" in report
    # the interrupted tuning run ended as an uninterrupted one
    from phaseloop.compare.runs import tuning_corpus
    from phaseloop.data import load_corpus

    tc = r.train_config(7, lr=1e-2)
    clean = train_mod.train(plan_variants(r, 256)[0].cfg, tc, tuning_corpus(load_corpus(str(text_file)), tc, 16),
                            tmp_path / "clean", progress=False)
    assert final_loss(out / "tune" / "rope" / "lr0.01-s7") == pytest.approx(clean["val_loss"], abs=1e-5)


def test_dry_run_lists_tuning_runs(text_file):
    msgs = []
    r = recipe(text_file, {"lr": [1e-3, 2e-3], "warmup_steps": [1, 2]}, variants=["rope", "three_phase N=3"])
    rows = {row["variant"]: row for row in dry_run(r, log=msgs.append, data=str(text_file))}
    assert rows["rope"]["tuning_runs"] == ["tune/rope/lr0.001-w1-s7", "tune/rope/lr0.001-w2-s7",
                                           "tune/rope/lr0.002-w1-s7", "tune/rope/lr0.002-w2-s7"]
    assert len(rows["three_phase N=3"]["tuning_runs"]) == 4
    assert all(math.isfinite(row["tuning_val_loss"]) for row in rows.values())
    assert any("tuning: 4 runs of 6 steps on the tuning slice" in m and "adds 2 more" in m for m in msgs)


def test_steps_override_caps_tuning_steps(text_file):
    r = apply_overrides(recipe(text_file, {"lr": [1e-3, 2e-3], "steps": 5}), steps=3)
    assert r.tune["steps"] == 3 and r.train["steps"] == 3
    with pytest.raises(RecipeError, match="also reported seeds"):
        apply_overrides(r, seeds="0,7")


def test_quick_recipe_has_the_control():
    """The main job compares 3PT with RoPE in 3PT's regime (N(0, 1) embedding, PyTorch
    init, no sqrt(d)) as well as with the reference."""
    r = load_recipe(None)
    v = {x.name: x for x in r.variants}
    three = next(x for x in r.variants if x.spec.startswith("three_phase"))
    control = v[three.control]
    cfgs = {p.name: p.cfg for p in plan_variants(r, 256)}
    assert control.spec == "rope" and control.name != r.reference
    c, t = cfgs[control.name], cfgs[three.name]
    assert ((c.embed_init_std, c.init, c.embed_scale) == (t.embed_init_std, t.init, t.embed_scale)
            == (1.0, "torch", False))


def test_variants_option_drops_a_control_left_out():
    msgs = []
    r = apply_overrides(load_recipe(None), variants=["rope", "three_phase N=3"], log=msgs.append)
    assert [v.control for v in r.variants] == [None, None]
    assert any("its control 'rope (3PT regime)' is not among --variants" in m for m in msgs)


def test_a_diverged_tuning_run_scores_infinite_and_is_not_redone(tmp_path, text_file, monkeypatch):
    from phaseloop.engine.trainer import DivergedError

    r = recipe(text_file, {"lr": [1e-3, 3e-3, 1e-2], "extend": 0})
    real_train, calls = train_mod.train, []

    def train(model_cfg, tc, data, out_dir, **kw):
        calls.append(Path(out_dir).name)
        if tc.lr == 1e-2:  # as the trainer does at a non-finite loss
            raise DivergedError("step 1: loss nan: training diverged")
        return real_train(model_cfg, tc, data, out_dir, **kw)

    monkeypatch.setattr(train_mod, "train", train)
    s = run_comparison(r, tmp_path / "cmp", progress=False, log=None)
    t = s["tuning"]["rope"]
    assert [math.isfinite(row["loss"]) for row in t["points"]] == [True, True, False]
    assert t["chosen"]["lr"] in (1e-3, 3e-3) and t["extensions"] == 0
    assert (tmp_path / "cmp" / "tune" / "rope" / "lr0.01-s7" / "diverged.json").exists()
    assert "| 0.01 | diverged |" in (tmp_path / "cmp" / "report.md").read_text()
    calls.clear()
    run_comparison(r, tmp_path / "cmp", progress=False, log=None)
    assert calls == []  # every run finished (the diverged one included): nothing redone


def test_dry_run_counts_the_budget_matched_models_the_comparison_trains(text_file):
    from phaseloop.compare.budget import plan_variants

    r = load_recipe(REPO / "recipes" / "universal.toml")
    rows = {row["variant"]: row for row in dry_run(r, log=None, data=str(text_file))}
    for p in plan_variants(r):
        assert rows[p.name]["total"] == p.counts["total"] and rows[p.name]["matched"] == p.matched, p.name
    assert rows["transformer (depth-matched)"]["matched"]  # 6 layers, not the preset's 4


def test_dry_run_refuses_a_bad_variant_before_its_first_line(text_file):
    """Every variant resolves before the first one trains: a bad second variant is the
    only thing a dry run says (one line at the CLI), not after the first variant's row."""
    msgs = []
    bad = {"name": "wide", "spec": "rope", "set": {"d_model": "x"}}
    r = Recipe.from_dict(dict(name="x", variants=["rope", bad], seeds=[0], train={"steps": 2}))
    with pytest.raises(PhaseloopError, match="d_model"):
        dry_run(r, log=msgs.append, data=str(text_file))
    assert msgs == []


def test_a_grid_points_score_is_its_seeds_mean_and_sample_spread(tmp_path):
    """score: the seeds' mean val loss and its sample standard deviation; a point where any
    seed diverged scores inf (the others' mean would make a diverging rate look good)."""
    from types import SimpleNamespace

    from phaseloop.compare.runs import DIVERGED
    from phaseloop.compare.tune import score

    runs = []
    for s, loss in ((0, 3.0), (1, 3.2)):
        (tmp_path / f"s{s}").mkdir()
        (tmp_path / f"s{s}" / "summary.json").write_text(json.dumps({"val_loss": loss}))
        runs.append(SimpleNamespace(run_dir=tmp_path / f"s{s}", seed=s))
    got = score(runs)
    assert got["loss"] == pytest.approx(3.1) and got["std"] == pytest.approx(math.sqrt(0.02))
    (tmp_path / "s1" / "summary.json").unlink()
    (tmp_path / "s1" / DIVERGED).write_text("")
    assert score(runs)["loss"] == float("inf")
