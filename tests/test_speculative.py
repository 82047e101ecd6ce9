"""Self-speculative decoding (issue 39, decoding.speculative_decode): greedy output is the
full depth's on every weight-tied trunk (float64); the acceptance arithmetic gives p
exactly; sampled outputs follow the full depth's distribution (a total-variation bound
from the sample count, which an always-accepting sampler breaks); refusals in one line."""

import math

import pytest
import torch

from phaseloop import ConfigError, ModelConfig, build_model, decoding
from phaseloop.decoding import accept_probs, verify
from phaseloop.early_exit import parse_exit
from phaseloop.inference import Options, generate

torch.set_num_threads(1)

FULL = 4
TRUNKS = [("universal-tiny", {}), ("universal-act-tiny", {"act_halting_bias_init": -2.0}),
          ("looped-tiny", {}), ("hyperloop-tiny", {}), ("hyperloop-tiny", {"hc_transition": "pooled_mlp"})]
IDS = [p + ("-pooled" if o.get("hc_transition") else "") for p, o in TRUNKS]  # the pooled variant's running
# sums roll back with the cache (hyperconn.RunningSums)


def _model(preset, dtype=torch.float64, **over):
    """Weights at std 0.2 so that the depth changes the argmax (drafts get rejected)."""
    torch.manual_seed(0)
    m = build_model(ModelConfig.from_preset(preset, init_std=0.2, **over)).eval().to(dtype)
    m.trunk.set_depth(FULL, extend="last")
    return m


@pytest.mark.parametrize("preset,over", TRUNKS, ids=IDS)
def test_greedy_is_the_full_depths_greedy(preset, over):
    m = _model(preset, **over)
    idx = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    full = generate(m, idx, Options(max_new_tokens=14))
    rates = []
    for draft, k in ((1, 3), (2, 4)):
        g = generate(m, idx, Options(max_new_tokens=14, speculative=draft, draft_tokens=k))
        assert torch.equal(g.ids, full.ids), (draft, k)
        assert m.trunk.passes == FULL and g.rounds >= 1
        rates.append(g.acceptance)
    assert min(rates) < 1, rates  # drafts were rejected: the rollback ran


def test_acceptance_counts_the_drafts_each_row_keeps(monkeypatch):
    """Rows of a batch keep the prefix they all accepted (m drafts), and a row whose own
    verification went further keeps d[m] as its next token: acceptance = those / drafted,
    not the drafts each row's verification accepted."""
    seen = []

    def recorded(*a, **kw):
        j_B, after_B = verify(*a, **kw)
        seen.append(j_B.tolist())
        return j_B, after_B
    monkeypatch.setattr(decoding, "verify", recorded)
    m = _model("universal-tiny")
    idx = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    g = generate(m, idx, Options(max_new_tokens=14, speculative=1, draft_tokens=4))
    assert any(len(set(j)) > 1 for j in seen), seen  # rows accepted different numbers of drafts
    kept = sum(len(j) * min(j) + sum(x > min(j) for x in j) for j in seen)
    drafted = sum(len(j) * k for j, k in zip(seen, _draft_counts(14, 4, seen), strict=True))
    assert g.acceptance == pytest.approx(kept / drafted, abs=1e-12) and g.rounds == len(seen)
    # an eos on a kept draft with kept drafts after it: the output ends there, and so do the
    # drafts it counts (row 0 alone: each round's m drafts from position ``at``)
    rows, at, cut = idx[:1], 1, None
    seen.clear()
    alone = generate(m, rows, Options(max_new_tokens=14, speculative=1, draft_tokens=4))
    for j in seen:
        if j[0] >= 2 and cut is None:
            cut = at  # the round's first draft: an eos there drops the round's other drafts
        at += j[0] + 1
    assert cut is not None, seen
    eos = int(alone.tokens[0, cut])
    seen.clear()
    g = generate(m, rows, Options(max_new_tokens=14, speculative=1, draft_tokens=4, eos_id=eos))
    L, at, kept = g.tokens.shape[1], 1, 0
    for j in seen:
        kept += max(0, min(j[0], L - at))
        at += j[0] + 1
    assert g.tokens[0, -1] == eos and kept < sum(j[0] for j in seen)  # drafts were dropped
    assert g.acceptance == pytest.approx(kept / sum(_draft_counts(14, 4, seen)), abs=1e-12)


def _draft_counts(new: int, k: int, seen: list) -> list:
    """Drafts per round: ``k``, fewer in the round that reaches ``new`` tokens."""
    counts, made = [], 1  # the prefill's token
    for j in seen:
        counts.append(min(k, new - made))
        made += min(j) + 1
    return counts


def test_the_acceptance_arithmetic_gives_p_exactly():
    """sum_d q(d) [keep(d) e_d + (1 - keep(d)) residual] = p (Leviathan et al. 2023, Thm. 1)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p, q = (torch.rand(7, generator=g, dtype=torch.float64) ** 3 for _ in range(2))
        p, q = p / p.sum(), q / q.sum()
        keep, res = accept_probs(p, q)
        out = (q * keep) + (q * (1 - keep)).sum() * res
        torch.testing.assert_close(out, p, atol=1e-14, rtol=0)
    same_keep, _ = accept_probs(p, p)
    assert torch.equal(same_keep, torch.ones_like(p))


def test_verify_counts_the_accepted_prefix():
    V, K = 5, 3
    p = torch.eye(V, dtype=torch.float64)[torch.tensor([[2, 4, 1, 0]])]  # one-hot: argmax 2, 4, 1, then 0
    j, after = verify(p, None, torch.tensor([[2, 4, 3]]))  # greedy: the third draft disagrees
    assert j.tolist() == [2] and after.tolist() == [1]
    j, after = verify(p, None, torch.tensor([[2, 4, 1]]))  # all kept: the bonus is p_K's argmax
    assert j.tolist() == [3] and after.tolist() == [0]
    q = p[:, :K].clone()
    j, after = verify(p, q, torch.tensor([[2, 4, 1]]), torch.Generator().manual_seed(0))  # q = p: kept
    assert j.tolist() == [3] and after.tolist() == [0]
    q[0, 1] = torch.full((V,), 1 / V)  # d_2 = 3 has p_2(3) = 0: rejected
    j, after = verify(p, q, torch.tensor([[2, 3, 1]]), torch.Generator().manual_seed(0))
    assert j.tolist() == [1] and after.tolist() == [4]  # the residual of p_2 - q_2 is e_4


def _exact(m, prompt, V, n):
    """The full depth's probability of every continuation of ``n`` tokens [V**n]."""
    cont = torch.cartesian_prod(*[torch.arange(V)] * n).view(-1, n)
    ids = torch.cat([prompt.expand(len(cont), -1), cont], 1)
    with torch.no_grad():
        logp = torch.log_softmax(m(ids).logits.double(), -1)[:, prompt.shape[1] - 1:-1]
    return logp.gather(-1, cont[..., None])[..., 0].sum(1).exp(), V ** torch.arange(n - 1, -1, -1)


def _tv(m, prompt, V, n, N, **kw):
    p, weights = _exact(m, prompt, V, n)
    g = generate(m, prompt.expand(N, -1), Options(max_new_tokens=n, temperature=1.0, seed=3, **kw))
    counts = torch.bincount((g.tokens * weights).sum(1), minlength=len(p)).double()
    return 0.5 * (counts / N - p).abs().sum().item(), g


def test_sampled_tokens_follow_the_full_depths_distribution(monkeypatch):
    """N rows, 3 new tokens of a 3-token vocabulary (M = 27 outcomes): with probability
    1 - delta the total variation of N samples is below sqrt((M ln 2 + ln(2/delta)) / 2N)
    (a union bound over the 2^M events, Hoeffding); delta = 1e-6."""
    V, n, N = 3, 3, 4000
    m = _model("looped-tiny", dtype=torch.float32, vocab_size=V, d_model=16, n_heads=2, n_kv_heads=2, d_ff=32)
    with torch.no_grad():
        m.head.weight.mul_(4)  # peaked distributions, which the draft's depth changes
    prompt = torch.tensor([[1]])
    M = V ** n
    eps = math.sqrt((M * math.log(2) + math.log(2 / 1e-6)) / (2 * N))
    tv, g = _tv(m, prompt, V, n, N, speculative=1, draft_tokens=2)
    assert tv < eps and g.rounds >= 1 and 0 < g.acceptance < 1, (tv, eps, g.acceptance)

    def accept_all(p, q, d, generator=None):  # a wrong rule: every draft kept
        B, K = d.shape
        return torch.full((B,), K), torch.multinomial(p[:, K], 1, generator=generator)[:, 0]
    monkeypatch.setattr(decoding, "verify", accept_all)
    wrong, _ = _tv(m, prompt, V, n, N, speculative=1, draft_tokens=2)
    assert wrong > 2 * eps, (wrong, eps)  # the bound would catch it


@pytest.mark.parametrize("preset", ["rope-tiny", "3pt-tiny", "mhc-tiny"])
def test_stacks_refuse_in_one_line(preset):
    m = build_model(ModelConfig.from_preset(preset))
    with pytest.raises(ConfigError, match="stack of distinct layers") as e:
        generate(m, torch.zeros(1, 2, dtype=torch.long), Options(max_new_tokens=2, speculative=1))
    assert "\n" not in str(e.value) and "looped" in str(e.value)


def test_bad_options_refused():
    m = _model("looped-tiny")
    x = torch.zeros(1, 2, dtype=torch.long)
    for opts, pattern in ((Options(speculative=FULL), "1 .. 3 passes"),
                          (Options(speculative=1, exit=parse_exit("kl:1")[0]), "drop --exit"),
                          (Options(speculative=1, use_cache=False), "drop --no-cache"),
                          (Options(speculative=1, draft_tokens=0), "positive integer"),
                          (Options(speculative=1, kv_share=1), "drop --kv-share")):
        with pytest.raises(ConfigError, match=pattern):
            generate(m, x, opts)


@pytest.mark.parametrize("preset,over", TRUNKS, ids=IDS)
def test_eos_stops_where_plain_decoding_stops(preset, over):
    """With an eos id the output ends at the token by which every row has produced it, as
    plain decoding's; no new tokens: the model never runs (no cache bytes)."""
    m = _model(preset, **over)
    idx = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(1))
    seen = generate(m, idx, Options(max_new_tokens=14)).tokens
    for eos in {int(seen[0, 2]), int(seen[1, 5]), int(seen[0, 0])}:
        plain = generate(m, idx, Options(max_new_tokens=14, eos_id=eos))
        spec = generate(m, idx, Options(max_new_tokens=14, eos_id=eos, speculative=1, draft_tokens=3))
        assert torch.equal(spec.ids, plain.ids), eos
        assert len(spec.passes) == spec.tokens.shape[1]
    none = generate(m, idx, Options(max_new_tokens=0, speculative=1))
    assert torch.equal(none.ids, idx) and none.kv_cache_bytes == 0 and none.rounds == 0


@pytest.mark.parametrize("preset", ["universal-act-tiny", "looped-tiny"])
def test_passes_are_those_each_forward_ran(preset):
    """mean_passes of a speculative generation: the passes every drafted and verified
    position ran (ACT halts early: its step limit overstated them 2.5x), per token kept; a
    trunk without ACT runs its draft depth and full depth."""
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset(preset)).eval()
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append((i[0].shape[1], o.stats.get("exit_passes"))))
    g = generate(model, torch.tensor([[104, 101, 108, 108, 111]]), Options(max_new_tokens=8, speculative=1,
                                                                          draft_tokens=3))
    full = model.trunk.passes
    want = 0.0
    for k, (T, s) in enumerate(seen):
        last = k == 0  # the prompt: its last position's token
        if s is not None:
            want += float((s[:, -1:] if last else s).sum())
        else:
            want += (1 if last else T) * (full if last or T > 1 else 1)
    assert g.mean_passes == pytest.approx(want / len(g.passes))
    if preset == "universal-act-tiny":
        assert g.mean_passes < full  # halted before the step limit


@pytest.mark.parametrize("speculative", [None, 1])
def test_generation_is_timed_after_the_device_finished(monkeypatch, speculative):
    """``seconds`` (tokens/s) is read once the device ran what was queued: on CUDA a
    greedy decode that never reads a token would otherwise stop the clock early. The CUDA
    call is stood in for; on the CPU nothing is waited for."""
    import phaseloop.inference as inference

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: synced.append(device))
    assert inference.clock(torch.device("cuda", 1)) > 0 and synced == [torch.device("cuda", 1)]
    seen = []
    real = inference.clock
    monkeypatch.setattr(inference, "clock", lambda device: seen.append(device) or real(device))
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_preset("looped-tiny"))
    out = generate(model, torch.tensor([[1, 2, 3]]), Options(max_new_tokens=4, speculative=speculative))
    assert seen == [torch.device("cpu")] * 2 and out.seconds > 0 and synced == [torch.device("cuda", 1)]
