"""recipes/paper/: each parses, builds at full size on the meta device with the paper's
parameter counts, and trains at a shrunk shape under its own training settings (issue 16:
the paper recipes dry-run in CI so none of them rots)."""

from pathlib import Path

import pytest

from phaseloop.cli import main
from phaseloop.compare import load_recipe
from phaseloop.compare.dryrun import dry_run, shrink
from phaseloop.compare.recipe import resolve_variant

pytestmark = pytest.mark.usefixtures("one_thread")
PAPER = sorted((Path(__file__).resolve().parents[1] / "recipes" / "paper").glob("*.toml"))


def test_there_are_the_four_paper_recipes():
    assert {p.stem for p in PAPER} == {"3pt_123m_wikitext103", "3pt_5.5m_nsweep",
                                       "hyperloop_240m_fourway", "ut_act_lambada"}


@pytest.mark.parametrize("path", PAPER, ids=[p.stem for p in PAPER])
def test_dry_run(path):
    recipe = load_recipe(path)
    assert recipe.paper.get("source"), "each paper recipe names its source and numbers"
    rows = {r["variant"]: r for r in dry_run(recipe, log=None)}
    assert all(r["val_loss"] == r["val_loss"] and r["val_loss"] < 7 for r in rows.values())
    if path.stem == "hyperloop_240m_fourway":  # the paper counts without the input embedding
        want = {"transformer-238m": 238.0e6, "mhc-241m": 241.0e6, "looped-135m": 135.5e6,
                "hyperloop-135m": 135.7e6}
        for name, n in want.items():
            assert abs(rows[name]["without_input_embedding"] - n) / n < 0.005, name
    if path.stem == "3pt_123m_wikitext103":
        assert all(abs(r["total"] - 123.5e6) < 0.1e6 for r in rows.values())
        assert recipe.train["decay"] == "all" and recipe.train["steps"] == 30000
    if path.stem == "3pt_5.5m_nsweep":
        cfgs = [resolve_variant(v, recipe.scale) for v in recipe.variants]
        assert [c.n_phases for c in cfgs] == [1, 2, 3, 4, 6, 8, 12]
        assert all(abs(r["total"] - 5.46e6) < 0.01e6 for r in rows.values())
    if path.stem == "ut_act_lambada":
        cfgs = [resolve_variant(v, recipe.scale) for v in recipe.variants]
        assert [(c.n_steps, c.act) for c in cfgs] == [(6, False), (8, False), (9, False), (8, True)]
        assert all(c.ffn == "relu" and c.norm == "layer" and c.bias and not c.use_rope for c in cfgs)


def test_shrink_keeps_the_architecture():
    cfg = resolve_variant(load_recipe(PAPER[1]).variants[-1], "small")  # 3PT N=12
    small = shrink(cfg)
    assert (small.arch, small.n_phases, small.n_heads, small.init) == (cfg.arch, 12, cfg.n_heads, "torch")
    assert small.d_model % (2 * small.n_phases) == 0 and small.d_model <= 96


def test_cli_dry_run(capsys):
    assert main(["compare", str(PAPER[0]), "--dry-run", "--variants", "rope (paper baseline)"]) == 0
    assert "123,489,024 parameters at full size" in capsys.readouterr().out


@pytest.mark.parametrize("name, sequences", [("3pt_123m_wikitext103", 32), ("hyperloop_240m_fourway", 64)])
def test_the_launch_line_gives_the_papers_batch(name, sequences):
    """batch_size is per process: under the header's `torchrun --nproc-per-node 8` the global
    batch is the paper's (spec three-phase.md: 32 x 1024; the hyperloop recipe's 64 x 2048)."""
    path = next(p for p in PAPER if p.stem == name)
    assert "--nproc-per-node 8" in path.read_text()
    r = load_recipe(path)
    assert r.train["batch_size"] * r.train.get("grad_accum", 1) * 8 == sequences
