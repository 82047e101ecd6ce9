"""`phaseloop compare`: recipes, budget matching, speedups, the noise test, resume, report."""

import json
import math
from pathlib import Path

import pytest

import phaseloop.lm.train as train_mod
from phaseloop import registry
from phaseloop.cli import main
from phaseloop.compare import (
    Recipe,
    RecipeError,
    Variant,
    apply_overrides,
    first_reach,
    load_recipe,
    match_budget,
    measure,
    paired_t_test,
    plan_variants,
    resolve_variant,
    run_comparison,
    speedup,
    t_two_sided_p,
)
from phaseloop.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.toml"))
TINY_TRAIN = dict(steps=6, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=1, eval_every=2,
                  eval_windows=2, ckpt_every=2, log_every=1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from threads; one avoids oversubscribing shared CPUs."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_recipe(data, **kw) -> Recipe:
    d = dict(name="t", data=str(data), scale="tiny", seeds=[0, 1],
             variants=["rope", "three_phase N=3"], train=dict(TINY_TRAIN))
    d.update(kw)
    return Recipe.from_dict(d)


# ---------------------------------------------------------------------------- recipes
def test_builtin_quick_equals_shipped_file():
    assert load_recipe(None).to_dict() == load_recipe(REPO / "recipes" / "quick.toml").to_dict()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_shipped_recipes_plan_or_fail_clearly(path):
    """Every shipped recipe parses; planning succeeds when its archs are registered and
    otherwise fails with one RecipeError naming the missing architecture."""
    recipe = load_recipe(path)
    try:
        plan = plan_variants(recipe, 256)
    except RecipeError as e:
        assert "not registered" in str(e), e
        return
    assert [p.name for p in plan] == [v.name for v in recipe.variants]


@pytest.mark.parametrize("d, msg", [
    (dict(seed=[0]), "unknown key 'seed' (did you mean 'seeds'?)"),
    (dict(variants=[]), "no variants"),
    (dict(variants=["rope", "rope"]), "twice"),
    (dict(reference="ropy"), "did you mean 'rope'"),
    (dict(seeds=[0, 0]), "distinct"),
    (dict(match="param"), "match='param'"),
    (dict(train={"stpes": 3}), "stpes"),
    (dict(train={"seed": 3}), "train.seed"),
    (dict(variants=[{"spec": "rope", "sett": {}}]), "did you mean 'set'"),
])
def test_recipe_validation_errors(d, msg):
    base = dict(name="x", variants=["rope"], train={"steps": 2})
    with pytest.raises(RecipeError, match=None) as ei:
        Recipe.from_dict({**base, **d})
    assert msg in str(ei.value)


@pytest.mark.parametrize("spec, msg", [
    ("ropee", "did you mean 'rope'"),
    ("rope+actt", "unknown modifier +actt"),
    ("rope N", "bad token 'N'"),
    ("three_phase N=4", "n_phases=4"),  # 4 does not divide n_heads=6
    ("rope frobnicate=1", "unknown field(s) frobnicate"),
])
def test_bad_variants(spec, msg):
    with pytest.raises(RecipeError) as ei:
        resolve_variant(Variant(spec, spec), "tiny")
    assert msg in str(ei.value) and spec in str(ei.value)


def test_unregistered_arch_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(registry, "ARCHS", {k: v for k, v in registry.ARCHS.items() if k != "universal"})
    with pytest.raises(RecipeError, match="unknown architecture or preset 'universal'"):
        resolve_variant(Variant("ut", "universal+act"), "small")


def test_spec_aliases():
    assert resolve_variant(Variant("a", "three_phase N=1"), "tiny").n_phases == 1
    cfg = resolve_variant(Variant("b", "rope+paper"), "small")
    assert cfg.embed_scale and cfg.embed_init_std == 1.0 and cfg.d_model == 192
    cfg = resolve_variant(Variant("c", "3pt", set={"embed_scale": True}), "tiny")
    assert cfg.arch == "three_phase" and cfg.embed_scale


@pytest.mark.parametrize("alias", sorted(n for s in registry.all_archs() for n in (s.name, *s.aliases)))
def test_every_registered_alias_resolves(alias):
    cfg = resolve_variant(Variant(alias, alias), "tiny")
    assert measure(cfg, 16)["total"] > 0


# ---------------------------------------------------------------------------- budgets
def test_match_params_by_width_picks_the_closest():
    ref = measure(ModelConfig.from_preset("rope-tiny"), 16)
    start = ModelConfig.from_preset("3pt-tiny", d_model=48, d_ff=128)
    cfg, counts, info = match_budget(start, ref["total"], "params", "width", 16, 0.1)
    assert counts["total"] == measure(cfg, 16)["total"]
    assert abs(info["rel_diff"]) < 0.1
    assert cfg.d_ff / cfg.d_model == pytest.approx(128 / 48, rel=0.05)
    assert cfg.d_model % 12 == 0  # even head dim for 6 heads, N=3 | D with even d_phase
    for d in (cfg.d_model - 12, cfg.d_model + 12):  # both neighbours are further away
        other = measure(start.replace(d_model=d, d_ff=round(d * 128 / 48)), 16)["total"]
        assert abs(other - ref["total"]) >= abs(counts["total"] - ref["total"])


def test_match_flops_and_depth():
    ref = measure(ModelConfig.from_preset("rope-tiny"), 16)
    cfg, counts, info = match_budget(ModelConfig.from_preset("rope-tiny", n_layers=7),
                                     ref["flops_per_token"], "flops", "depth", 16, 0.01)
    assert cfg.n_layers == 2 and counts["flops_per_token"] == ref["flops_per_token"]
    cfg, counts, _ = match_budget(ModelConfig.from_preset("rope-tiny"), 5, "depth", "width", 16,
                                  0.1)
    assert cfg.n_layers == 5 and counts["depth"] == 5


def test_plan_matches_and_unreachable_budget_is_an_error():
    recipe = tiny_recipe("stdlib", variants=["rope", {"name": "w", "spec": "rope L=4"}],
                         match="params", match_by="width")
    plan = plan_variants(recipe, 256)
    assert plan[0].matched is None and plan[1].matched["to"] == "rope"
    assert abs(plan[1].counts["total"] / plan[0].counts["total"] - 1) < 0.1
    assert plan[1].cfg.n_layers == 4 and plan[1].cfg.d_model < 96
    bad = tiny_recipe("stdlib", variants=["rope", "rope D=384"], match="params",
                      match_by="depth", match_tolerance=0.01)
    with pytest.raises(RecipeError, match="unreachable"):
        plan_variants(bad, 256)


# ---------------------------------------------------------------------------- statistics
def test_first_reach_and_speedup_on_synthetic_curves():
    steps = [10, 20, 30, 40]
    ref = [4.0, 3.0, 2.5, 2.0]
    target = ref[-1]
    assert first_reach(steps, ref, target) == 40
    fast = [3.5, 2.5, 1.5, 1.0]  # crosses 2.0 halfway between 20 and 30
    assert first_reach(steps, fast, target) == pytest.approx(25.0)
    assert speedup(40, 25) == pytest.approx(1.6)
    assert first_reach(steps, [1.0, 0.9, 0.8, 0.7], target) == 10  # already there
    assert first_reach(steps, [5.0, 4.0, 3.0, 2.1], target) is None
    assert speedup(40, None) is None
    # wall-clock: same rule on (elapsed, loss); 2.0 reached 1/4 of the way from 8 to 12 s
    assert first_reach([4.0, 8.0, 12.0], [3.0, 2.2, 1.4], 2.0) == pytest.approx(9.0)
    # non-monotone reference: its own first crossing comes before its last step
    assert first_reach(steps, [4.0, 1.9, 2.1, 2.0], 2.0) == pytest.approx(10 + 10 * 2 / 2.1)


@pytest.mark.parametrize("t, df", [(12.706, 1), (4.303, 2), (3.182, 3), (2.776, 4),
                                   (2.571, 5), (2.447, 6), (2.228, 10), (2.086, 20)])
def test_t_distribution_critical_values(t, df):
    assert t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-4)


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7, 8])
def test_t_distribution_matches_numeric_integration(df):
    def pdf(x):
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    for t in (0.3, 1.0, 2.5):
        n = 2000  # Simpson on [0, t]
        h = t / n
        s = pdf(0) + pdf(t) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
        assert t_two_sided_p(t, df) == pytest.approx(1 - 2 * s * h / 3, abs=1e-7)
    assert t_two_sided_p(0.0, df) == pytest.approx(1.0)


def test_paired_t_test_verdicts():
    ref = [2.0, 2.1, 1.9, 2.05]
    better = paired_t_test(ref, [r - 0.1 + e for r, e in zip(ref, [0.01, -0.01, 0.0, 0.005])])
    assert better["verdict"] == "better" and better["p"] < 0.01 and better["df"] == 3
    worse = paired_t_test(ref, [r + 0.2 + e for r, e in zip(ref, [0.01, -0.02, 0.0, 0.01])])
    assert worse["verdict"] == "worse"
    noisy = paired_t_test(ref, [r + e for r, e in zip(ref, [0.1, -0.1, 0.05, -0.04])])
    assert noisy["verdict"] == "indistinguishable"
    # d = [0.1, 0.2, 0.3]: t = 0.2 / (0.1 / sqrt 3) = 3.464, df 2 -> p = 0.0742
    r = paired_t_test([1, 1, 1], [1.1, 1.2, 1.3])
    assert r["t"] == pytest.approx(3.4641, abs=1e-3) and r["p"] == pytest.approx(0.0742, abs=1e-3)
    assert r["verdict"] == "indistinguishable"
    assert paired_t_test([1.0], [0.5])["verdict"] == "n/a"
    same = paired_t_test([1.0, 2.0], [0.5, 1.5])  # identical differences: no noise estimate
    assert same["verdict"] == "n/a" and same["p"] is None and same["t"] is None and "-0.5" in same["note"]
    for ref, var in (([0.1, 0.2], [0.4, 0.5]), ([0.1, 0.2, 0.7], [0.4, 0.5, 1.0])):  # the same up to rounding
        same = paired_t_test(ref, var)  # (was t = 7.6e15, p = 0, "worse")
        assert same["verdict"] == "n/a" and same["p"] is None and "+0.3" in same["note"], same
    for ref, var in (([1.0, 2.0], [1.0000000000000002, 2.0]), ([3.0, 3.5, 4.0], [3.0, 3.5000000000000004, 4.0])):
        near = paired_t_test(ref, var)  # equal up to one ulp: identical, not "the same difference"
        assert near["verdict"] == "indistinguishable" and near["p"] == 1.0, near
    tie = paired_t_test([1.0, 2.0], [1.0, 2.0])
    assert tie["verdict"] == "indistinguishable" and tie["p"] == 1.0 and tie["t"] is None
    assert "2 seeds" in paired_t_test([1.0, 1.1], [0.5, 0.7])["note"]
    for bad in (float("nan"), float("inf"), None):  # a diverged run: no test, never "worse (p=0)"
        r = paired_t_test([3.8, 3.9, 3.7], [3.6, bad, 3.5])
        assert r["verdict"] == "n/a" and r["p"] is None and "not finite" in r["note"]
    assert math.isnan(t_two_sided_p(float("nan"), 3))


def test_report_of_a_run_that_ended_non_finite(tmp_path, text_file):
    """A run whose last loss was written as null (non-finite, --skip-nonfinite let it
    finish) is reported, its t-test n/a; a reference without evaluations is one error."""
    out = tmp_path / "c"
    recipe = tiny_recipe(text_file, train={**TINY_TRAIN, "steps": 2})
    run_comparison(recipe, out, progress=False, log=lambda m: None)
    run = out / "runs" / "three-phase-n-3-s1"
    run = run if run.is_dir() else next(p for p in (out / "runs").iterdir() if not p.name.startswith("rope"))
    s = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**s, "val_loss": None}))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lines = [{**r, "val_loss": None} if "val_loss" in r else r for r in lines]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run_comparison(recipe, out, progress=False, log=lambda m: None)  # finished: the report again
    verdicts = [v.get("vs_reference") or {} for v in json.loads((out / "summary.json").read_text())["variants"]]
    assert any(t.get("verdict") == "n/a" and "not finite" in t.get("note", "") for t in verdicts), verdicts
    for ref in (out / "runs").glob("rope-s*"):
        (ref / "metrics.jsonl").write_text("")
    with pytest.raises(RecipeError, match="has no evaluation step"):
        run_comparison(recipe, out, progress=False, log=lambda m: None)
    (out / "recipe.json").write_text("[1, 2]")  # valid JSON, not a recipe: damage named
    with pytest.raises(RecipeError, match="recipe.json is damaged"):
        run_comparison(recipe, out, progress=False, log=lambda m: None)


# ---------------------------------------------------------------------------- runner
def _evals(run_dir: Path) -> list:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "val_loss" in r]


def test_resume_after_interruption_between_steps_and_runs(tmp_path, text_file, monkeypatch):
    recipe = tiny_recipe(text_file)
    out = tmp_path / "cmp"

    def stop_mid_run(name, step, rec):  # interrupt run 2 between steps (after ckpt at 2)
        if name == "three_phase-N3-s0" and step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_comparison(recipe, out, progress=False, log=None, on_step=stop_mid_run)
    runs = out / "runs"
    assert (runs / "rope-s0" / "summary.json").exists()
    assert not (runs / "three_phase-N3-s0" / "summary.json").exists()
    ckpt = runs / "three_phase-N3-s0" / "checkpoint" / "trainer.json"
    assert json.loads(ckpt.read_text())["step"] == 2
    first_summary = (runs / "rope-s0" / "summary.json").read_bytes()

    calls = []
    real_train = train_mod.train

    def train_then_stop_between_runs(model_cfg, tc, data, out_dir, **kw):
        calls.append(Path(out_dir).name)
        if Path(out_dir).name == "rope-s1":  # interrupted before run 3 starts
            raise KeyboardInterrupt
        return real_train(model_cfg, tc, data, out_dir, **kw)

    monkeypatch.setattr(train_mod, "train", train_then_stop_between_runs)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(recipe, out, progress=False, log=None)
    assert calls == ["three_phase-N3-s0", "rope-s1"]  # the finished run was not redone
    assert (runs / "three_phase-N3-s0" / "summary.json").exists()

    calls.clear()
    monkeypatch.setattr(train_mod, "train", lambda *a, **kw: (calls.append(Path(a[3]).name),
                                                               real_train(*a, **kw))[1])
    run_comparison(recipe, out, progress=False, log=None)
    assert calls == ["rope-s1", "three_phase-N3-s1"]
    assert (runs / "rope-s0" / "summary.json").read_bytes() == first_summary
    # the run interrupted between steps ends exactly as an uninterrupted one
    plan = {p.name: p for p in plan_variants(recipe, 256)}
    train_mod.train(plan["three_phase N=3"].cfg, recipe.train_config(0), str(text_file),
                    tmp_path / "clean", progress=False)
    got, want = _evals(runs / "three_phase-N3-s0"), _evals(tmp_path / "clean")
    assert [r["step"] for r in got] == [2, 4, 6]
    assert [r["val_loss"] for r in got] == pytest.approx([r["val_loss"] for r in want], abs=1e-5)

    # report, summary and plots exist and are non-empty
    for f in ("summary.json", "report.md", "recipe.json", "val_loss_vs_step.png",
              "val_loss_vs_time.png", "params_vs_loss.png"):
        assert (out / f).stat().st_size > 0, f
    report = (out / "report.md").read_text()
    assert "| three_phase N=3 |" in report and recipe.data in report
    s = json.loads((out / "summary.json").read_text())
    v = {x["name"]: x for x in s["variants"]}
    assert v["rope"]["step_speedup"] == pytest.approx(1.0)
    assert v["three_phase N=3"]["vs_reference"]["n"] == 2
    assert v["rope"]["params"] == 252384 and v["rope"]["depth"] == 2
    assert s["data"]["fingerprint"] and s["machine"]["cpu_count"] and s["software"]["torch"]

    assert load_recipe(out / "recipe.json").to_dict() == recipe.to_dict()  # reproducible

    # a different recipe into the same folder: one error, nothing overwritten
    before = (out / "recipe.json").read_bytes()
    with pytest.raises(RecipeError, match="different comparison"):
        run_comparison(apply_overrides(recipe, seeds="0"), out, progress=False, log=None)
    # another batch: seeds still to train would take it (a run resumes at its own global batch)
    import dataclasses

    other = dataclasses.replace(recipe, train={**recipe.train, "batch_size": 2 * recipe.train["batch_size"]})
    with pytest.raises(RecipeError, match=r"different comparison \(train.batch_size"):
        run_comparison(other, out, progress=False, log=None)
    assert (out / "recipe.json").read_bytes() == before


def test_report_without_matplotlib(tmp_path, text_file, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    msgs = []
    recipe = tiny_recipe(text_file, seeds=[0], variants=["rope"], train={**TINY_TRAIN, "steps": 2})
    run_comparison(recipe, tmp_path / "c", progress=False, log=msgs.append)
    assert (tmp_path / "c" / "report.md").stat().st_size > 0
    assert (tmp_path / "c" / "summary.json").exists()
    assert not list((tmp_path / "c").glob("*.png"))
    assert any("matplotlib is not installed" in m for m in msgs)


# ---------------------------------------------------------------------------- CLI
def test_cli_compare_ci_recipe_and_bad_input(tmp_path, text_file, capsys):
    out = tmp_path / "ci"
    args = ["compare", str(REPO / "recipes" / "ci.toml"), "--data", str(text_file), "--out",
            str(out), "--steps", "4", "--seeds", "0", "--quiet"]
    assert main(args) == 0
    assert "| rope |" in capsys.readouterr().out
    assert (out / "report.md").exists()
    stored = json.loads((out / "recipe.json").read_text())["recipe"]
    assert stored["train"]["steps"] == 4 and stored["seeds"] == [0]

    capsys.readouterr()
    assert main(args[:-3] + ["--seeds", "0,1", "--quiet"]) == 2  # a different comparison
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the --steps notes
    assert err.startswith("phaseloop: error:") and "different comparison" in err

    fresh = tmp_path / "fresh"
    for bad in (["--variants", "rope", "bogus"], ["--seeds", "a,b"]):
        assert main(["compare", "--out", str(fresh), "--quiet", *bad]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    typo = tmp_path / "typo.toml"
    typo.write_text('name = "x"\nvariants = ["rope"]\nseedz = [0]\n')
    assert main(["compare", str(typo), "--out", str(fresh)]) == 2
    assert "did you mean 'seeds'" in capsys.readouterr().err
    assert not fresh.exists()




def test_a_context_longer_than_a_variants_model_is_refused_before_the_folder_is_claimed(tmp_path, text_file):
    recipe = tiny_recipe(text_file, train={**TINY_TRAIN, "seq_len": 100000})
    with pytest.raises(RecipeError, match=r"variant 'rope': seq_len 100000 is longer than its model's max_seq_len"):
        run_comparison(recipe, tmp_path / "out", progress=False, log=None)
    assert not (tmp_path / "out").exists()  # the corrected recipe may take the folder


def test_steps_of_the_recipes_own_count_change_nothing():
    r = load_recipe(REPO / "recipes" / "ci.toml")
    msgs = []
    assert apply_overrides(r, steps=r.train["steps"], log=msgs.append).to_dict() == r.to_dict() and msgs == []
    assert apply_overrides(r, steps=4, log=msgs.append).train["eval_every"] == 1 and msgs  # shrunk: they follow


def test_match_to_without_a_budget_to_match_is_refused():
    r = Recipe.from_dict({"variants": [{"name": "a", "spec": "rope"}, {"name": "b", "spec": "rope", "match_to": "a"}],
                          "match": "none", "scale": "tiny"})
    with pytest.raises(RecipeError, match="match_to='a' with no budget to match"):
        plan_variants(r)


def test_seed_mean_curves_budgets_and_the_table_arithmetic():
    """The seed-mean curve averages time as it averages loss, its band runs from the
    lowest to the highest seed; a budget picks the closest depth and reports
    (got - target) / target, refusing a shortfall beyond the tolerance as an excess; the
    table's PPL column shows PPL's own spread and FLOPs in millions."""
    from phaseloop.analysis.params import measure
    from phaseloop.compare.budget import match_budget
    from phaseloop.compare.options import RecipeError
    from phaseloop.compare.report import format_table
    from phaseloop.compare.stats import mean_curve

    m = mean_curve([{"step": [10, 20], "val_loss": [3.0, 2.0], "elapsed_s": [1.0, 2.0]},
                    {"step": [10, 20], "val_loss": [2.0, 1.0], "elapsed_s": [3.0, 6.0]}])
    assert m["elapsed_s"] == [2.0, 4.0] and m["lo"] == [2.0, 1.0] and m["hi"] == [3.0, 2.0]
    c = ModelConfig.from_preset("rope-tiny")
    p2, p3 = (measure(c.replace(n_layers=n), 16)["total"] for n in (2, 3))
    target = p2 + (p3 - p2) // 10
    cfg, _, info = match_budget(c, target, "params", "depth", 16, 0.5)
    assert cfg.n_layers == 2 and info["rel_diff"] == pytest.approx((p2 - target) / target)
    with pytest.raises(RecipeError):
        match_budget(c, 2 * measure(c.replace(n_layers=64), 16)["total"], "params", "depth", 16, 0.1)
    ms = lambda mean, std: {"mean": mean, "std": std}
    v = {"name": "rope", "finished_seeds": [0, 1], "params": 1000, "depth": 2, "flops_per_token": 2e6,
         "tok_per_s": ms(100, None), "mfu": ms(None, None), "peak_memory_mb": ms(10, None),
         "val_loss": ms(3.0, 0.1), "val_bpb": ms(1.5, 0.05), "val_ppl": ms(20.0, 2.0),
         "step_speedup": None, "wallclock_speedup": None, "vs_reference": None, "settings": {}}
    row = format_table({"variants": [v], "lr": 1e-3}).splitlines()[-1]
    assert "| 2.00 |" in row and "20.00 ± 2.00" in row, row
