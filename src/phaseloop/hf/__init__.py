"""Hugging Face integration (the ``hf`` extra: ``pip install 'phaseloop[hf]'``).

* ``PhaseloopConfig`` (``configuration.py``) / ``PhaseloopForCausalLM`` (``modeling.py``):
  every phaseloop architecture as a ``transformers`` causal LM, wrapping the same
  ``DecoderLM``; the run's tokenizer as a ``PreTrainedTokenizerFast`` (``tokenizer.py``);
* ``from_run`` / ``export_run`` (``export.py``): a run as an in-memory model + tokenizer,
  or a ``save_pretrained`` folder that ``AutoModelForCausalLM.from_pretrained`` loads;
* ``lm_eval_run`` (``harness.py``): lm-evaluation-harness on a run, with local LAMBADA
  and WikiText-2 tasks;
* ``downstream.py`` (+ ``downstream_data.py``, ``scoring.py``): HellaSwag, PIQA, ARC,
  Winogrande, OpenBookQA, BoolQ, SciQ and LAMBADA offline (``eval --tasks``, ``[eval]``).

``import phaseloop`` registers the classes with ``AutoConfig`` / ``AutoModelForCausalLM``
without importing ``transformers`` itself (seconds): at once if ``transformers`` is
already imported, else right after it is (``register_when_imported``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

from phaseloop.errors import ConfigError

EXTRA = "pip install 'phaseloop[hf]'"


def require(*modules: str) -> None:
    """One line naming the extra when transformers / lm-eval is not installed."""
    for name in modules or ("transformers",):
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"this needs the {name} library, which is not installed: {EXTRA}")


def register() -> None:
    """Register PhaseloopConfig / PhaseloopForCausalLM with the Auto classes: importing
    ``modeling`` does it, at its end. Called while ``modeling`` itself is being imported
    (its ``import transformers`` fires the hook), it leaves that to the module."""
    if f"{__name__}.modeling" in sys.modules:
        return
    from phaseloop.hf import modeling  # noqa: F401


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the loader of ``transformers`` so that ``register``
    runs once the package has been executed."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            try:
                register()
            except Exception as e:  # never break the user's import of transformers
                warnings.warn(f"phaseloop could not register its transformers classes: {e}", stacklevel=2)

        spec.loader.exec_module = exec_then_register
        return spec


def register_when_imported() -> None:
    if "transformers" in sys.modules:
        try:
            register()
        except Exception as e:
            warnings.warn(f"phaseloop could not register its transformers classes: {e}", stacklevel=2)
    elif importlib.util.find_spec("transformers") is not None and \
            not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def __getattr__(name: str):
    if name in ("PhaseloopConfig", "PhaseloopForCausalLM", "PhaseloopCache"):
        require()
        from phaseloop.hf import modeling
        return getattr(modeling, name)
    if name in ("from_run", "export_run"):
        require()
        from phaseloop.hf import export
        return getattr(export, name)
    raise AttributeError(name)
