"""lm-evaluation-harness's `local-completions` model against `phaseloop serve` equals lm-eval on
the Hugging Face model (`phaseloop lm-eval`'s HFLM) on the LAMBADA subset the repository
runs (`lambada_local`, offline) and on a last-word task the model has learned (so that
some answers are greedy and the accuracy is not 0 on both sides): the same accuracy, the
same greedy flag per document and every document's log-likelihood to 1e-4 (fp32 logits,
sums of a few log-probabilities), scored through echo + logprobs."""

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("openai")
pytest.importorskip("starlette")

from conftest import write_corpus

from phaseloop.cli import main
from phaseloop.data.tokenizer import ByteTokenizer
from phaseloop.hf.harness import lm_eval_run, resolved_tasks
from phaseloop.hf.tokenizer import hf_tokenizer
from phaseloop.serve.loading import load
from phaseloop.serve.runner import Background, Config

pytestmark = pytest.mark.usefixtures("one_thread")
LIMIT = 10  # LAMBADA passages (<= 1,000 bytes each: no window truncates them on either side)


FOX = ["the quick brown fox", "jumps over the lazy dog", "over the lazy dog. the quick brown fox",
       "the quick brown cat", "jumps over the lazy fox", "the lazy dog jumps over the", "brown fox jumps over"]


def _fox_task(inc):
    inc.mkdir()
    (inc / "fox.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in FOX))
    (inc / "fox_words.yaml").write_text(
        "task: fox_words\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {json.dumps(str(inc / 'fox.jsonl'))}\n"
        "output_type: loglikelihood\ntest_split: test\ndoc_to_text: \"{{text.split(' ')[:-1]|join(' ')}}\"\n"
        "doc_to_target: \"{{' '+text.split(' ')[-1]}}\"\nmetric_list:\n  - metric: acc\n")


def test_local_completions_equals_lm_eval_on_the_hf_model(data_dir, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    run, inc, tasks = tmp_path / "run", tmp_path / "tasks", ["lambada_local", "fox_words"]
    assert main(["train", "--preset", "rope-tiny", "--set", "max_seq_len=1024", "--seq-len", "64", "--steps", "150",
                 "--batch-size", "8", "--lr", "3e-3", "--warmup", "10", "--eval-every", "150", "--eval-windows", "2",
                 "--quiet", "--data", str(write_corpus(tmp_path / "fox.txt")), "--out", str(run)]) == 0
    _fox_task(inc)
    hf_res = lm_eval_run(run, tasks, include_path=str(inc), limit=LIMIT, batch_size=4, log_samples=True, write=False)
    tok_dir = tmp_path / "tokenizer"
    hf_tokenizer(ByteTokenizer()).save_pretrained(tok_dir)
    with Background(load(run), Config(port=0, max_batch=8)) as bg:
        lm = LocalCompletionsAPI(base_url=f"{bg.url}/v1/completions", model=run.name, tokenizer_backend="huggingface",
                                 tokenizer=str(tok_dir), max_length=1024, num_concurrent=4, max_retries=1)
        with resolved_tasks(tasks, include_path=str(inc), data=str(data_dir)) as (manager, _):
            api_res = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=LIMIT, log_samples=True,
                                      bootstrap_iters=0)
        requests = {s.labels["status"]: s.value for s in bg.server.metrics.requests.collect()[0].samples
                    if s.name.endswith("_total") and s.labels["route"] == "completions"}
    assert requests == {"200": LIMIT + len(FOX)}  # every document scored by the server, none refused
    for task, n in (("lambada_local", LIMIT), ("fox_words", len(FOX))):
        hf = {s["doc_id"]: s["resps"][0][0] for s in hf_res["samples"][task]}
        api = {s["doc_id"]: s["resps"][0][0] for s in api_res["samples"][task]}
        assert sorted(hf) == sorted(api) == list(range(n))
        worst = max(abs(hf[d][0] - api[d][0]) for d in hf)
        assert worst < 1e-4, (task, worst)
        assert [hf[d][1] for d in range(n)] == [api[d][1] for d in range(n)], task  # greedy or not, per document
        assert api_res["results"][task]["acc,none"] == hf_res["results"][task]["acc,none"]
    assert 0 < api_res["results"]["fox_words"]["acc,none"] < 1  # some greedy, some not: the flags are compared
