"""The serve decode loop itself (serve/engine.py), without HTTP: a group whose forward fails
ends its own rows with an error while the other groups decode on (before, one failing group
ended every request in flight), and the joinable-settings record stays bounded however many
distinct settings clients send."""

import torch

from phaseloop import ModelConfig, build_model
from phaseloop.early_exit import ExitRule
from phaseloop.serve import engine as engine_mod
from phaseloop.serve.engine import Engine
from phaseloop.serve.options import Settings
from phaseloop.serve.sequence import Sampling, Sequence


def _model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_preset("universal-tiny", vocab_size=64)).eval()


def _seq(settings, events, max_new=6):
    return Sequence([1, 2, 3], max_new, Sampling(temperature=0), settings, lambda ids: "", events.append)


def test_a_failing_group_ends_only_its_own_rows(monkeypatch):
    eng = Engine(_model(), max_batch=8)
    bad, good = Settings(depth=2), Settings(depth=3)
    real = Engine._step

    def step(self, g):
        if g.settings == bad:
            raise RuntimeError("a forward that fails")
        return real(self, g)

    monkeypatch.setattr(Engine, "_step", step)
    events: list = []
    failing, fine = [_seq(bad, events) for _ in range(2)], [_seq(good, events) for _ in range(2)]
    eng.submit(failing + fine)
    with torch.inference_mode():
        while eng.waiting or eng.groups:
            eng._turn()
    assert [s.finish for s in failing] == ["error", "error"]
    assert [s.finish for s in fine] == ["length", "length"] and all(len(s.tokens) == 6 for s in fine)
    alone = Engine(_model(), max_batch=8)  # the fine rows' tokens are those they decode alone
    again = [_seq(good, [])]
    alone.submit(again)
    with torch.inference_mode():
        while alone.waiting or alone.groups:
            alone._turn()
    assert fine[0].tokens == again[0].tokens


def test_the_joinable_record_is_bounded(monkeypatch):
    monkeypatch.setattr(engine_mod, "JOINABLE_KEPT", 3)
    eng = Engine(_model(), max_batch=1)
    seqs = [_seq(Settings(exit=ExitRule("state", 0.1 + i / 100)), [], max_new=1) for i in range(5)]
    with torch.inference_mode():
        for s in seqs:
            eng.submit([s])
            while eng.waiting or eng.groups:
                eng._turn()
    assert all(s.finish == "length" for s in seqs)
    assert list(eng.joinable) == [s.settings for s in seqs[-3:]]  # the oldest went first


def test_text_a_tokenizer_keeps_nothing_of_is_a_400():
    """A tokenizer that encodes a prompt (or the rendered chat) to no token: a 400 naming the
    field, not an empty prompt for the model (a 500)."""
    import pytest

    from phaseloop.serve import schema

    limits = schema.Limits(max_context=64, vocab_size=256)
    for call, param in ((lambda: schema.completion({"prompt": ["ok", "§"]}, lambda t: [] if t == "§" else [1], limits),
                         "prompt"),
                        (lambda: schema.chat({"messages": [{"role": "user", "content": "§"}]}, lambda m: "§",
                                             lambda t: [], limits), "messages")):
        with pytest.raises(schema.APIError) as e:
            call()
        assert e.value.status == 400 and e.value.param == param and "encodes to no token" in e.value.message


def test_a_request_keeps_the_default_it_leaves_out():
    """depth and extend_loops: the one a request leaves out keeps the server's (or export's)
    default. A Hyperloop served at --depth 3 --extend-loops last refused {"depth": 3}, and
    {"extend_loops": "last"} alone (its depth the default's)."""
    from phaseloop import ModelConfig, build_model
    from phaseloop.serve.options import parse, resolve

    twin = build_model(ModelConfig.from_preset("hyperloop-tiny"), device="meta").eval()
    server = Settings(depth=3, extend_loops="last")
    for given in ({"depth": 3}, {"extend_loops": "last"}, {"depth": 3, "extend_loops": "last"}):
        assert resolve(twin, given, server) == server
    assert parse({"depth": 2}, server) == Settings(depth=2, extend_loops="last")
    assert parse({"depth": None}, server) == Settings()  # the trained depth: nothing to extend
    assert parse({"extend_loops": None}, server) == Settings(depth=3)
    assert parse({"extend_loops": "last"}, Settings()) == Settings(extend_loops="last")  # check() refuses it


# ------------------------------------------------------------ a sequence's text and a response's numbers
def _text_seq(**kw):
    return Sequence([0], 10, kw.pop("sampling", Sampling(0.0)), Settings(), lambda ids: "".join(chr(i) for i in ids),
                    lambda e: None, **kw)


def test_the_earliest_stop_string_cuts_the_text_and_eos_is_not_shown():
    s = _text_seq(stop=["b", "ab"])
    for ch in "xabd":
        if s.finish is None:
            s.push(ord(ch), None)
    assert (s.text, s.finish) == ("x", "stop")  # "ab" starts before "b"
    s = _text_seq(eos_id=ord("$"))
    for ch in "hi$":
        s.push(ord(ch), None)
    assert (s.text, s.finish) == ("hi", "stop")


def test_each_choice_of_a_seeded_request_draws_its_own_stream():
    """n choices of one seeded request: choice i seeds seed + i, so they differ and each
    is reproducible."""
    draws = []
    for index in (0, 1, 0):
        s = _text_seq(sampling=Sampling(1.0, seed=7), index=index)
        s.seed_on("cpu")
        draws.append(torch.randint(0, 1000, (3,), generator=s.generator).tolist())
    assert draws[0] != draws[1] and draws[0] == draws[2]
    assert draws[1] == torch.randint(0, 1000, (3,), generator=torch.Generator().manual_seed(8)).tolist()


def test_usage_top_logprobs_and_the_context_limit():
    """usage counts every prompt's tokens; top_logprobs list the most probable first; a
    prompt plus max_tokens may fill max_context exactly."""
    from types import SimpleNamespace as NS

    import pytest

    from phaseloop.serve.responses import Vocab, _chat_logprobs, usage
    from phaseloop.serve.schema import APIError, Limits, _check_length

    req = NS(prompts=[[1, 2, 3], [4, 5]])
    got = usage(req, [NS(tokens=[7, 8], speculation=None), NS(tokens=[9], speculation=None)])
    assert got == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    v = Vocab(lambda ids: "".join(chr(i) for i in ids), lambda t: bytes([t]), True)
    out = _chat_logprobs([97], [(-0.1, {97: -0.1, 98: -2.5, 99: -4.0})], v, 2)
    assert [(e["token"], e["logprob"]) for e in out["content"][0]["top_logprobs"]] == [("a", -0.1), ("b", -2.5)]
    _check_length([[1] * 6], 10, Limits(max_context=16, vocab_size=256))  # 16 of 16
    with pytest.raises(APIError, match="maximum context is 16 tokens; the prompt has 6 and max_tokens asks for 11"):
        _check_length([[1] * 6], 11, Limits(max_context=16, vocab_size=256))
