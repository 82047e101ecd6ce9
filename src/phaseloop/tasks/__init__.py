"""Task data, metrics and demos: algorithmic tasks (copy, reverse, addition, prefix
parity), user JSONL data, bAbI QA, and the hand-set prefix-parity scan demo."""

from phaseloop.analysis.stats import mean_std
from phaseloop.tasks._errors import TaskDataError, TaskDataNotFound
from phaseloop.tasks.algorithmic import (
    BITS,
    DIGITS,
    PAPER_TEST_LENGTHS,
    PAPER_TRAIN_LENGTHS,
    TASKS,
    TEST_LENGTHS,
    TRAIN_LENGTHS,
    Example,
    TaskSpec,
    make_examples,
    parse_lengths,
    position_offsets,
    prefix_parity,
)
from phaseloop.tasks.babi import (
    BabiExample,
    babi_files,
    failed_tasks,
    format_example,
    load_babi,
    normalize_answer,
    parse_babi,
    parse_babi_file,
    ponder_by_supporting,
    task_error,
)
from phaseloop.tasks.jsonl import load_jsonl, save_jsonl
from phaseloop.tasks.metrics import char_accuracy, per_length_metrics, sequence_accuracy
from phaseloop.tasks.parity_demo import (
    ScanTrace,
    render_demo,
    run_fixed_stack,
    run_shared,
    run_without_step_signal,
    scan_step,
    steps_needed,
    steps_needed_without_signal,
)
from phaseloop.tasks.vocab import CharVocab

__all__ = [
    "TaskDataError",
    "TaskDataNotFound",
    "BITS",
    "DIGITS",
    "PAPER_TEST_LENGTHS",
    "PAPER_TRAIN_LENGTHS",
    "TASKS",
    "TEST_LENGTHS",
    "TRAIN_LENGTHS",
    "CharVocab",
    "Example",
    "TaskSpec",
    "make_examples",
    "parse_lengths",
    "position_offsets",
    "prefix_parity",
    "BabiExample",
    "babi_files",
    "failed_tasks",
    "format_example",
    "load_babi",
    "normalize_answer",
    "parse_babi",
    "parse_babi_file",
    "ponder_by_supporting",
    "task_error",
    "load_jsonl",
    "save_jsonl",
    "char_accuracy",
    "mean_std",
    "per_length_metrics",
    "sequence_accuracy",
    "ScanTrace",
    "render_demo",
    "run_fixed_stack",
    "run_shared",
    "run_without_step_signal",
    "scan_step",
    "steps_needed",
    "steps_needed_without_signal",
]
