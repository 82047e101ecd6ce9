"""transformers' own common model tests (issue 31) for every registered architecture.

``ModelTesterMixin`` and ``ConfigTester`` come from the installed transformers' sdist
(``tests/hf_common/fetch.py``, run by ``.ci/run``); ``GenerationTesterMixin``, which the
sdist lacks, is phaseloop's, written to the contract of transformers' own
(``tests/hf_common/generation_contract.py``; the sdist's stand-in re-exports it, so
``test_generation_tester_mixin_inheritance`` runs). One small tester class per
architecture of ``phaseloop.registry`` (a plugin's arch is picked up the same way), at
transformers' tester sizes (vocab 99, d_model 32, 2 layers or steps). Tests of features
no causal LM here has are skipped with the reason (``SKIP``). Items 1-7 of the issue each
have a test of their own in tests/test_hf_conformance.py (which runs without the sdist).

Without the fetched files the module skips (outside CI) or fails (``CI=true``).
"""

from __future__ import annotations

import os
import sys
import unittest

import pytest
import torch

pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "hf_common"))
import fetch
from test_hf_conformance import VARIANTS, tiny_config

from phaseloop import ModelConfig
from phaseloop.hf.modeling import PhaseloopConfig, PhaseloopForCausalLM

PKG = fetch.package_dir()


def _absent(why: str):
    if os.environ.get("CI", "").lower() == "true":
        raise RuntimeError(f"CI=true: {why}")
    pytest.skip(why, allow_module_level=True)


if not (PKG / "test_modeling_common.py").is_file():
    _absent(f"transformers' common tests are not fetched ({PKG}); run "
            "`python tests/hf_common/fetch.py` (.ci/run does)")
try:
    import parameterized  # noqa: F401  (transformers' tests use it; the dev extra installs it)
except ImportError:
    _absent("transformers' common tests need the parameterized package (pip install -e '.[dev]')")

fetch.write_standins(PKG)  # an extraction by an older fetch.py gets the current stand-ins
sys.path.insert(0, str(PKG.parent))
from generation_contract import GenerationTesterMixin  # noqa: E402
from hf_sdist_tests.test_configuration_common import ConfigTester  # noqa: E402
from hf_sdist_tests.test_modeling_common import ModelTesterMixin  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

class PhaseloopModelTester:
    batch_size = 3
    seq_length = 7
    is_training = True

    def __init__(self, parent, phaseloop: dict):
        self.parent = parent
        self.phaseloop = phaseloop
        cfg = ModelConfig.from_dict(phaseloop)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layers
        self.num_attention_heads = cfg.n_heads

    def get_config(self) -> PhaseloopConfig:
        return PhaseloopConfig(phaseloop=dict(self.phaseloop))

    def prepare_config_and_inputs_for_common(self):
        ids = torch.randint(0, self.vocab_size, (self.batch_size, self.seq_length))
        return self.get_config(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


HIDDEN = ("sets output_hidden_states=True, which PhaseloopForCausalLM refuses (issue 31 item 2: "
          "the trunks have no common per-layer state; test_refused_outputs_are_errors)")
# test name -> why it does not apply to these models
SKIP: dict[str, str] = {
    "test_eager_matches_sdpa_inference":
        "one attention implementation (SDPA, as phaseloop computes it): no eager path to compare; it also "
        "sets output_hidden_states and right-pads, both refused",
    "test_batching_equivalence": HIDDEN + "; rows of a batch equal each row alone: test_hf.py "
        "(left padding) and test_batch_rows_equal_alone here",
    "test_hidden_states_output": HIDDEN,
    "test_retain_grad_hidden_states_attentions": HIDDEN,
    "test_model_outputs_equivalence": HIDDEN + "; return_dict=False equals the ModelOutput's "
        "to_tuple(): test_return_dict_false_is_a_tuple",
}


# parameterized leaves the template of its expanded tests, which pytest does not collect
SKIP_TEMPLATES = {"test_eager_matches_sdpa_inference"}


def _skipped(name: str, why: str):
    def test(self):
        self.skipTest(why)
    test.__name__ = name
    return test


def _make(arch: str, over: dict):
    cfg = tiny_config(arch, **over)
    tag = arch + "".join(f"_{k}" for k in over)

    def setUp(self):
        self.model_tester = PhaseloopModelTester(self, cfg)
        self.config_tester = ConfigTester(self, config_class=PhaseloopConfig, phaseloop=cfg)

    def test_config(self):
        self.config_tester.run_common_tests()

    def _prepare_for_class(self, inputs_dict, model_class, return_labels=False):
        """transformers adds labels for the classes of its causal-LM mapping; ours is not in it."""
        inputs = ModelTesterMixin._prepare_for_class(self, inputs_dict, model_class, return_labels)
        if return_labels:
            inputs["labels"] = inputs["input_ids"].clone()
        return inputs

    body = {"all_model_classes": (PhaseloopForCausalLM,), "setUp": setUp, "test_config": test_config,
            "_prepare_for_class": _prepare_for_class, "__module__": __name__,
            # attention weights are refused (SDPA returns none): transformers' own switch, its
            # attention-output tests skip themselves ("Model does not output attentions")
            "has_attentions": False}
    for attr in dir(ModelTesterMixin):  # parameterized tests are expanded to name_00_...
        base = next((n for n in SKIP if attr == n or (attr.startswith(n + "_") and attr[len(n) + 1:][:2].isdigit())),
                    None)
        if base and attr not in SKIP_TEMPLATES:
            body[attr] = _skipped(attr, SKIP[base])
    return f"TestHFCommon_{tag}", type(f"TestHFCommon_{tag}", (ModelTesterMixin, GenerationTesterMixin,
                                                                unittest.TestCase), body)


for _arch, _over in VARIANTS:
    _name, _cls = _make(_arch, _over)
    globals()[_name] = _cls
del _name, _cls
