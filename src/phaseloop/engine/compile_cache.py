"""Where compiled artefacts and compile measurements live: inductor's caches inside
phaseloop's cache folder (``use_cache``), and ``records.json`` there, which keeps per
block shape what this machine measured (a cold compile's seconds, a warm load's, the
saving) and whether inductor's vector-ISA checks passed (``trust_vec_isa``)."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch

from phaseloop.files import atomic_write_bytes, cache_dir


def cache_root():

    return cache_dir() / "compile"


def use_cache() -> None:
    """Point inductor's on-disk caches into phaseloop's cache folder (unless the user set
    one). Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR the first time
    anything asks for it, so that value counts as unset."""
    root = cache_root() / f"torch-{torch.__version__}"
    now = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if now is None or os.path.abspath(now) == os.path.abspath(_inductor_default_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    if backend() == "inductor":
        trust_vec_isa()


def _inductor_default_dir() -> str:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # moved: only a value the user set explicitly is then kept
        return ""
    return default_cache_dir()


def trust_vec_isa() -> None:
    """Inductor checks each vector ISA the CPU advertises by building a test library and
    loading it in a child Python, in every process: 0.9 s of a warm run's first step on
    the 2-core CPU. Once the checks passed for this torch, compiler, Python and CPU
    (``records.json``), later processes tell inductor (``config.cpp.vec_isa_ok``); the
    first one checks before it compiles and sets it too, so every process compiles under
    the same inductor settings (they are part of its cache keys). Where a check fails,
    or elsewhere than x86-64 Linux, inductor keeps checking for itself."""
    import platform

    import torch._inductor.config as ic

    if ic.cpp.vec_isa_ok is not None or sys.platform != "linux" or platform.machine() != "x86_64":
        return  # the user decided (TORCHINDUCTOR_VEC_ISA_OK), or not the case measured
    from torch._inductor import cpu_vec_isa
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        flags = sorted(cpu_vec_isa.x86_isa_checker())
        flagged = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
        parts = [torch.__version__, sys.executable, get_cpp_compiler(), os.environ.get("ATEN_CPU_CAPABILITY", ""),
                 *flags, *map(str, flagged)]
    except Exception:
        return
    key = "vec_isa:" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]
    ok = _read_records().get(key)
    if not isinstance(ok, bool):
        ok = bool(flagged) and all(_isa_builds(isa) for isa in flagged)  # inductor's own checks, once
        _write_record(key, ok)
    if ok:
        ic.cpp.vec_isa_ok = True


def _isa_builds(isa) -> bool:
    return bool(isa)  # inductor's check: build a test library with the ISA's flags, load it in a child


def backend() -> str:
    """torch.compile's backend: inductor, or $PHASELOOP_COMPILE_BACKEND (aot_eager / eager
    capture the same graphs without code generation: to isolate an inductor problem)."""
    return os.environ.get("PHASELOOP_COMPILE_BACKEND") or "inductor"


RECORD_KEYS = ("compile_s", "load_s")


SAVINGS_KEPT = 8  # the saving is the median of the last runs' measurements: one run's is noisy


def _records_path():
    return cache_root() / "records.json"


def _read_records() -> dict:
    try:
        data = json.loads(_records_path().read_text())
    except (OSError, ValueError):
        return {}  # no record (or an unreadable one: it is only an estimate's input)
    return data if isinstance(data, dict) else {}


def read_record(key: str) -> dict:
    """What runs on this machine measured for ``key``: compile_s (a cold compile), load_s
    (a warm load), saving (the fraction of an eager step it saved: the median of the last
    ``SAVINGS_KEPT`` runs' measurements); only those measured."""
    v = _read_records().get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool):  # records before the saving was kept
        return {"compile_s": float(v)}
    if not isinstance(v, dict):
        return {}
    out = {k: float(v[k]) for k in RECORD_KEYS if _number(v.get(k))}
    savings = [float(x) for x in v.get("savings", []) if _number(x)] if isinstance(v.get("savings"), list) else []
    return {**out, "savings": savings, "saving": median(savings)} if savings else out


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


def update_record(key: str, saving: float | None = None, **seconds: float) -> None:
    """Set a cold compile's or a warm load's seconds; add a measured ``saving``."""
    rec = read_record(key)
    savings = rec.pop("savings", [])
    rec.pop("saving", None)
    rec.update({k: round(float(v), 4) for k, v in seconds.items()})
    if saving is not None:
        savings = [*savings, round(float(saving), 4)][-SAVINGS_KEPT:]
    _write_record(key, {**rec, **({"savings": savings} if savings else {})})


def _write_record(key: str, value) -> None:

    data = _read_records()
    data[key] = value
    try:
        _records_path().parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(_records_path(), json.dumps(data, indent=1, sort_keys=True).encode())
    except OSError:
        pass  # a read-only cache costs only the estimate
