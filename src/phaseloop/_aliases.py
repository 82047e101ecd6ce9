"""The import paths of modules that moved into subpackages (0.2.0, docs/architecture.md):
``import phaseloop.train`` still works and gives the very module object
``phaseloop.lm.train``, so attributes set on either name (``monkeypatch`` included) are
seen by both. Standard library only: installed by ``phaseloop/__init__`` first."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

MOVED = {  # old path -> where the module lives now
    "phaseloop.rope": "phaseloop.archs.rope",
    "phaseloop.three_phase": "phaseloop.archs.three_phase",
    "phaseloop.universal": "phaseloop.archs.universal",
    "phaseloop.act": "phaseloop.archs.act",
    "phaseloop.hyperloop": "phaseloop.archs.hyperloop",
    "phaseloop.hyperconn": "phaseloop.archs.hyperconn",
    "phaseloop.seq2seq": "phaseloop.archs.seq2seq",
    "phaseloop.models": "phaseloop.archs",
    "phaseloop.three_phase_cli": "phaseloop.cli.three_phase_cmd",
    "phaseloop.sources": "phaseloop.data.sources",
    "phaseloop.store": "phaseloop.data.store",
    "phaseloop.tokenizer": "phaseloop.data.tokenizer",
    "phaseloop.tokenizer_train": "phaseloop.data.tokenizer_train",
    "phaseloop.checkpoint": "phaseloop.engine.checkpoint",
    "phaseloop.initfrom": "phaseloop.engine.initfrom",
    "phaseloop.params": "phaseloop.analysis.params",
    "phaseloop.accounting": "phaseloop.analysis.accounting",
    "phaseloop.probe": "phaseloop.analysis.probe",
    "phaseloop.plots": "phaseloop.analysis.plots",
    "phaseloop.universal_explain": "phaseloop.analysis.ut_explainer",
    "phaseloop.train": "phaseloop.lm.train",
    "phaseloop.runconfig": "phaseloop.lm.runconfig",
    "phaseloop.tasks.models": "phaseloop.tasks.task_model",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)  # the real module, not a copy

    def exec_module(self, module) -> None:
        pass  # already executed under its own name


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED[fullname]))


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
