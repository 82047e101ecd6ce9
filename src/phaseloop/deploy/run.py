"""``phaseloop export RUN --format executorch --out FILE.pte``: a trained run as an
ExecuTorch program, with its tokenizer and a record of what was exported beside it.

Three files, each written to a temporary name in the same folder and renamed, the
``.pte`` last (``write_all``), so an interrupted export leaves the folder as it was:

* ``FILE.pte``: the program (``program.py``'s contract; ``pte.py`` lowers it);
* ``FILE.tokenizer.json``: the run's tokenizer as a tokenizer.json (the byte tokenizer
  as a byte-level BPE with no merges), which ExecuTorch's ``TextLLMRunner`` reads;
* ``FILE.json``: arch, depth, bits, the quantised layers, the metadata, the run and the
  sha256 of its weights and of the ``.pte``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from pathlib import Path

from phaseloop.data.tokenizer import ByteTokenizer, byte_level_tokenizer
from phaseloop.deploy import pte, record_digest, sidecars
from phaseloop.deploy.program import metadata, prepare
from phaseloop.engine.checkpoint import checkpoint_weights, load_run, run_folder, run_tokenizer
from phaseloop.errors import PhaseloopError
from phaseloop.files import check_out_dir, dumps, publish_new, read_unchanged


def check_out(out: Path) -> None:
    """A new ``.pte`` path in a writable folder; refused in one line before anything runs."""
    if out.suffix != ".pte":
        raise PhaseloopError(f"--out {out}: an ExecuTorch program is a .pte file; pass --out NAME.pte")
    if out.parent.exists() and not out.parent.is_dir():
        raise PhaseloopError(f"--out {out} lies under the file {out.parent}; choose another --out")
    check_out_dir(out.parent)  # under a file, or not writable: one line
    for p in (out, *sidecars(out)):
        if p.exists() or p.is_symlink():
            raise PhaseloopError(f"--out {out}: {p} exists; choose a new name or remove it (nothing was written)")


def tokenizer_json(tok) -> bytes:
    if isinstance(tok, ByteTokenizer):
        return byte_level_tokenizer().to_str().encode()
    return Path(tok.path).read_bytes()


def export_run(run: str | Path, out: str | Path, *, depth: int | None = None, extend_loops: str | None = None,
               bits: int | None = None, max_len: int | None = None, backend: str = "xnnpack",
               head: bool = False) -> dict:
    """Write ``run`` as ``out`` (a new ``.pte``) and its sidecars; returns the record."""
    out = Path(out)
    check_out(out)
    if bits is not None and bits not in pte.BITS:
        raise PhaseloopError(f"--bits {bits}: choose 8 or 4")
    if head and bits is None:
        raise PhaseloopError("--head quantises the output head with the other Linears: add --bits 8 or --bits 4")
    t0 = time.perf_counter()
    run_dir = run_folder(run)
    with read_unchanged(checkpoint_weights(run), run_dir) as digest:
        model, run_cfg = load_run(run, "cpu")  # no checkpoint: refused here
    weights_sha256 = digest["sha256"]
    tok = run_tokenizer(run, run_cfg)
    program = prepare(model, depth, extend_loops, max_len)
    quantized = pte.quantize_linears(program, bits, head) if bits else []
    meta = metadata(program, tok)
    data = pte.lower(program, meta, backend)
    tok_path, record_path = sidecars(out)
    tok_json = tokenizer_json(tok)
    record = {"format": "executorch", "backend": backend, "arch": model.cfg.arch,
              "depth": depth, "extend_loops": extend_loops,  # None: the trained depth
              "passes": program.model.trunk.passes,  # what every token runs (None: a stack; ACT: the bound)
              "kv_cache_bytes": sum(b.nbytes for b in program.cache.buffers()),
              "bits": bits, "head": head, "quantized_layers": quantized, "metadata": meta, "bytes": len(data),
              "pte_sha256": hashlib.sha256(data).hexdigest(),
              "tokenizer": tok_path.name, "tokenizer_sha256": hashlib.sha256(tok_json).hexdigest(),
              "run": str(run_dir.resolve()),
              "checkpoint_sha256": weights_sha256,
              "export_s": round(time.perf_counter() - t0, 1)}
    record["record_sha256"] = record_digest(record)
    write_all([(tok_path, tok_json), (record_path, (dumps(record, indent=2) + "\n").encode()),
               (out, data)])  # the .pte last: one on disk comes with its sidecars
    return {**record, "out": str(out)}


def write_all(files: list[tuple[Path, bytes]]) -> None:
    """Write every file (all in one folder, made if missing) under a temporary name, then
    rename them in order; on any failure (a full disk, Ctrl-C) remove the temporary files,
    the files this call renamed already and the folders it made: all is as it was."""
    staged, done, path = [], [], None
    parent = files[0][0].parent
    made = [p for p in (parent, *parent.parents) if not p.exists()]  # removed again on failure
    try:
        parent.mkdir(parents=True, exist_ok=True)
        for path, data in files:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            staged.append(Path(tmp))
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
        for (path, _), tmp in zip(files, staged):
            publish_new(tmp, path)
            done.append(path)
    except BaseException as e:
        for p in (*staged, *done):
            p.unlink(missing_ok=True)
        for p in made:
            with contextlib.suppress(OSError):
                p.rmdir()
        if isinstance(e, OSError):  # name the file asked for, not its temporary name
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise

