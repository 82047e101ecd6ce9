"""Token store build speed and memory (issue 12): MB/s of ``phaseloop.data.store.build``
against the ``tokenizers`` library's own ``encode_batch`` on the same pieces and cores,
and against a single-process loop of ``encode`` calls; then peak memory for corpora of
growing size, and a build under a data-segment limit a quarter of the corpus.

Goals: store / encode_batch >= 0.8 (phaseloop adds little over the library), store /
loop >= 1.7 on 2 cores, memory bounded (flat in the corpus size).

    python benchmarks/bench_tokenize.py                  # ~3 min on 2 cores
    python benchmarks/bench_tokenize.py --mb 8 --rounds 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(os.environ.get("PHASELOOP_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))


def corpus(path: Path, mb: float) -> Path:
    """Tiny Shakespeare and WikiText-2 (valid, test) repeated to ``mb`` megabytes."""
    parts = [DATA / "tinyshakespeare" / "input.txt", DATA / "wikitext-2" / "wiki.valid.raw",
             DATA / "wikitext-2" / "wiki.test.raw"]
    blob = b"".join(p.read_bytes() for p in parts if p.exists())
    with open(path, "wb") as f:
        for _ in range(max(1, int(mb * 1e6 / len(blob)))):
            f.write(blob)
    return path


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


CHILD = """
import resource, sys
open('/proc/self/clear_refs', 'w').write('5')  # peak RSS from here (it survives fork + exec)
from phaseloop import sources, store
from phaseloop.data.tokenizer import load_tokenizer
def vmdata():
    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmData')) * 1024
src, tok = sources.resolve(sys.argv[1]), load_tokenizer(sys.argv[2])
base = vmdata()
if float(sys.argv[3]) > 0:
    lim = base + int(float(sys.argv[3]) * 2**20)
    resource.setrlimit(resource.RLIMIT_DATA, (lim, lim))
st = store.build(src, tok)
peak = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')) / 1024
print(st.manifest['tokens'], f"{peak:.0f}", f"{base / 2**20:.0f}")
"""


def child_build(path: Path, tok: str, limit_mb: float, cache: Path):
    env = {**os.environ, "PHASELOOP_CACHE": str(cache)}
    shutil.rmtree(cache, ignore_errors=True)
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), tok, str(limit_mb)], capture_output=True,
                         text=True, env=env)
    if out.returncode:
        return None
    tokens, peak, base = out.stdout.split()
    return int(tokens), float(peak), float(base)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=20, help="corpus size for the speed comparison")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from phaseloop.data import sources, store
    from phaseloop.data.tokenizer_train import train_tokenizer

    work = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    os.environ["PHASELOOP_CACHE"] = str(work / "cache")
    text = corpus(work / "corpus.txt", args.mb)
    tok = train_tokenizer(str(DATA / "tinyshakespeare" / "input.txt"), "bpe", args.vocab, work / "tok",
                          progress=False)
    src = sources.resolve(text)
    mb = text.stat().st_size / 1e6
    pieces = [p.decode() for p in sources.safe_pieces(sources._file_blocks(text), False)]

    def build():
        shutil.rmtree(work / "cache", ignore_errors=True)
        store.build(src, tok)

    runs = {"store.build": build,
            "encode_batch": lambda: tok.tok.encode_batch(pieces, add_special_tokens=False),
            "encode_batch_fast": lambda: tok.tok.encode_batch_fast(pieces, add_special_tokens=False),
            "encode loop (1 process)": lambda: [tok.tok.encode(p, add_special_tokens=False) for p in pieces]}
    times = {k: [] for k in runs}
    for _ in range(args.rounds):  # interleaved
        for k, fn in runs.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"token store build, byte-level BPE {tok.vocab_size} on {mb:.1f} MB ({len(pieces)} pieces), "
          f"{os.cpu_count()} cores, median of {args.rounds} interleaved rounds")
    for k, s in med.items():
        print(f"  {k:<26} {mb / s:7.2f} MB/s")
    print(f"  store / encode_batch       {med['encode_batch'] / med['store.build']:7.3f}   goal >= 0.8")
    print(f"  store / encode_batch_fast  {med['encode_batch_fast'] / med['store.build']:7.3f}   "
          "(the store encodes without offsets, as this does)")
    print(f"  store / loop               {med['encode loop (1 process)'] / med['store.build']:7.3f}   goal >= 1.7")

    print("peak memory of a build (fresh child process; its RSS includes torch's import)")
    for name, sizes in (("bytes", (16, 64, 256)), (str(tok.path), (4, 16))):
        for size in sizes:
            path = corpus(work / f"c{size}.txt", size)
            r = child_build(path, name, 0, work / "c")
            label = "bytes" if name == "bytes" else "bpe"
            print(f"  {label:<6} {path.stat().st_size / 1e6:7.1f} MB corpus: peak RSS {r[1]:6.0f} MB "
                  f"(data segment before the build {r[2]:.0f} MB)")
            path.unlink()
    path = corpus(work / "c256.txt", 256)
    r = child_build(path, "bytes", 64, work / "c")
    print(f"  bytes, {path.stat().st_size / 1e6:.0f} MB corpus under RLIMIT_DATA = before + 64 MB: "
          f"{'built, ' + str(r[0]) + ' tokens' if r else 'FAILED'}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
