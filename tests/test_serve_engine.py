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
