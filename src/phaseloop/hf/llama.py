"""``phaseloop export RUN --format llama``: a Llama run (``llama_map.refusal`` None) as a
transformers ``LlamaForCausalLM`` folder: config.json of ``model_type`` "llama" (no
remote code, no phaseloop needed to load it), model.safetensors under Llama's names,
generation_config.json and the run's tokenizer as a ``PreTrainedTokenizerFast``
(``hf.tokenizer``). vLLM, TGI, llama.cpp's converter and every tool that reads a Llama
folder take it. Written into a temporary folder beside ``out`` and renamed
(``export.atomic_folder``)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from phaseloop.config import ModelConfig
from phaseloop.engine.checkpoint import run_folder, run_tokenizer
from phaseloop.errors import PhaseloopError
from phaseloop.files import dumps, writing
from phaseloop.hf.export import atomic_folder, new_folder, no_progress_bar
from phaseloop.hf.llama_map import hyperparameters, llama_tensors, source_model
from phaseloop.hf.tokenizer import hf_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def llama_config(cfg: ModelConfig) -> LlamaConfig:
    """transformers' ``LlamaConfig`` of a Llama ``ModelConfig``; no BOS / EOS / pad (phaseloop
    trains on raw text)."""
    hp = hyperparameters(cfg)
    theta = hp.pop("rope_theta")
    return LlamaConfig(**hp, rope_parameters={"rope_type": "default", "rope_theta": theta},
                       bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       architectures=["LlamaForCausalLM"])


def to_llama(model) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` holding the weights of a Llama ``DecoderLM``, fp32, eval mode."""
    conf = llama_config(model.cfg)
    llama = LlamaForCausalLM(conf)
    missing, unexpected = llama.load_state_dict(llama_tensors(model), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise PhaseloopError(f"internal: Llama names do not match ({(unexpected or missing)[:2]})")
    if conf.tie_word_embeddings:
        llama.tie_weights()
    return llama.eval()


def export_llama(run: str | Path, out: str | Path, dtype: str = "float32",
                 quantized: str | Path | None = None) -> Path:
    """Write a Llama run as a ``LlamaForCausalLM`` folder at ``out`` (absent or empty)."""
    if dtype not in DTYPES:
        raise PhaseloopError(f"--dtype {dtype}: choose {' or '.join(DTYPES)}")
    out = new_folder(out)
    model, run_cfg = source_model(run, quantized, "llama")
    llama = to_llama(model).to(DTYPES[dtype])
    fast = hf_tokenizer(run_tokenizer(run, run_cfg))
    with atomic_folder(out) as tmp:
        with writing(out / "model.safetensors"), no_progress_bar():  # a full disk: an OSError
            llama.save_pretrained(tmp)
        GenerationConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None).save_pretrained(tmp)
        fast.save_pretrained(tmp)
        (tmp / "phaseloop.json").write_text(dumps({
            "run": str(run_folder(run).resolve()), "format": "llama", "dtype": dtype,
            "quantized": None if quantized is None else Path(quantized).name,
            "model": run_cfg["model"], "data": run_cfg.get("data")}, indent=2))
    return out
