"""The Llama baseline under Llama's names: which runs are a plain Llama, their
hyperparameters and their weights as transformers' ``LlamaForCausalLM`` names them.
``export --format llama`` (a transformers folder) and ``--format gguf`` (llama.cpp) both
start here; nothing in this module imports transformers.

A ``rope`` run is a Llama (Touvron et al. 2023, §2.2) when its block is the Llama block:
SwiGLU, RMSNorm, RoPE, no biases, and every option of its option groups (3PT's phases,
rotation, horn, ...) off. phaseloop's fused projections split exactly: ``kv_proj``
[2 K E, D] is k then v (``Attention.project_kv``), ``gate_up`` [2 F, D] is gate then up
(``SwiGLU``). RMSNorm (eps inside the square root) and rotate-half RoPE over the whole
head dimension (``layers.rope_tables``) are Llama's. ``embed_scale`` (sqrt(d) times the
embedding) is folded into the embedding table: ``E * sqrt(d)`` is the very product
phaseloop computes per token, so the function is the same to the last bit; a tied head
then keeps the unscaled table (the export is untied).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from phaseloop import registry
from phaseloop.config import ModelConfig
from phaseloop.engine.checkpoint import load_run
from phaseloop.errors import PhaseloopError
from phaseloop.quant.load import load_dequantized, read_config

LLAMA_BLOCK = {"ffn": "swiglu", "norm": "rms", "bias": False, "use_rope": True}


def refusal(cfg: ModelConfig) -> str | None:
    """Why the model of ``cfg`` is not a plain Llama, naming the field; None when it is."""
    if cfg.arch != "rope":
        return "only a rope run with the Llama block is a Llama"
    for name, want in LLAMA_BLOCK.items():
        if getattr(cfg, name) != want:
            return f"{name}={getattr(cfg, name)!r} is not the Llama block (which has {name}={want!r})"
    for group in registry.groups_of(cfg.spec):
        for f in dataclasses.fields(group):
            if getattr(cfg, f.name) != f.default:
                return f"{f.name}={getattr(cfg, f.name)!r} is an option a Llama has no equivalent for"
    return None


def hyperparameters(cfg: ModelConfig) -> dict:
    """The Llama hyperparameters of ``cfg`` (transformers' ``LlamaConfig`` names)."""
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_base, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": cfg.tie_embeddings and not cfg.embed_scale}


def llama_tensors(model) -> dict[str, torch.Tensor]:
    """The weights of a Llama ``DecoderLM`` (``refusal`` None) under ``LlamaForCausalLM``'s
    names, fp32, detached (views of the model's own where no arithmetic is needed)."""
    cfg = model.cfg
    kv = cfg.n_kv_heads * cfg.head_dim
    emb = model.embed.tok.weight.detach().float()
    out = {"model.embed_tokens.weight": emb * math.sqrt(cfg.d_model) if cfg.embed_scale else emb}
    for i, block in enumerate(model.trunk.layers):
        p = f"model.layers.{i}."
        k_v = block.attn.kv_proj.weight.detach().float()
        gate_up = block.ffn.gate_up.weight.detach().float()
        out.update({
            p + "input_layernorm.weight": block.attn_norm.weight.detach().float(),
            p + "self_attn.q_proj.weight": block.attn.q_proj.weight.detach().float(),
            p + "self_attn.k_proj.weight": k_v[:kv], p + "self_attn.v_proj.weight": k_v[kv:],
            p + "self_attn.o_proj.weight": block.attn.o_proj.weight.detach().float(),
            p + "post_attention_layernorm.weight": block.ffn_norm.weight.detach().float(),
            p + "mlp.gate_proj.weight": gate_up[:cfg.d_ff], p + "mlp.up_proj.weight": gate_up[cfg.d_ff:],
            p + "mlp.down_proj.weight": block.ffn.down.weight.detach().float(),
        })
    out["model.norm.weight"] = model.norm.weight.detach().float()
    if not hyperparameters(cfg)["tie_word_embeddings"]:
        out["lm_head.weight"] = model.head.weight.detach().float()
    return out


def source_model(run: str | Path, quantized: str | Path | None, fmt: str):
    """(DecoderLM, run config) of a Llama run, with a quantised file's dequantised weights;
    another model refused in one line before its weights are read."""
    cfg = ModelConfig.from_dict(read_config(run)["model"])
    why = refusal(cfg)
    if why is not None:
        raise PhaseloopError(f"--format {fmt} cannot take this {cfg.arch} run: {why}")
    model, run_cfg = load_run(run, "cpu")
    if quantized:
        load_dequantized(model, quantized, run, run_cfg)
    return model, run_cfg
