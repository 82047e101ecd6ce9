"""``phaseloop export RUN --format gguf``: a Llama run as one GGUF file for llama.cpp (and
Ollama, LM Studio, ...), written with the ``gguf`` package (the ``gguf`` extra).

What llama.cpp's own converter (``convert_hf_to_gguf.py``, ``LlamaModel``) writes, from
the weights ``llama_map`` names: architecture "llama" and its hyperparameters; tensors
under GGUF's names (``gguf.get_tensor_name_map``); q_proj and k_proj rows permuted from
rotate-half RoPE (HF, phaseloop) to GGML's interleaved pairs (``permute``: without it
every position but the first differs); norms always f32, the matrices f32, f16 or Q8_0
(blocks of 32 int8 with an fp16 scale; a matrix whose rows are not whole blocks: f16).

Tokenizer: "gpt2" (byte-level BPE). The byte tokenizer is 256 byte tokens (GPT-2's
printable stand-ins, id = byte) and one merge (llama.cpp refuses a BPE without merges)
of two NUL bytes, whose result is no token, so every byte stays one token; a trained
byte-level BPE is its vocabulary and merges with GPT-2's pre-tokenizer regex. Ids past
the tokenizer's (a model vocabulary larger than it) are unused tokens. llama.cpp needs
an end-of-text token and phaseloop models have none: the first unused id, else the NUL
byte's token (text holds no NUL). Written to a temporary file beside ``out``, renamed.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from phaseloop.data.tokenizer import ByteTokenizer, _gpt2_byte_decoder
from phaseloop.engine.checkpoint import config_digest, run_folder, run_tokenizer
from phaseloop.errors import PhaseloopError
from phaseloop.files import check_out_dir, publish_new
from phaseloop.hf.llama_map import hyperparameters, llama_tensors, source_model

OUTTYPES = ("f32", "f16", "q8_0")
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
Q8 = gguf.GGMLQuantizationType.Q8_0


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rows of a q/k projection from rotate-half to interleaved RoPE pairs, per head
    (llama.cpp conversion/llama.py ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(name: str, cfg) -> int | None:
    if name.endswith("self_attn.q_proj.weight"):
        return cfg.n_heads
    if name.endswith("self_attn.k_proj.weight"):
        return cfg.n_kv_heads
    return None


def gguf_tokenizer(tok, vocab_size: int) -> dict:
    """What the GGUF's tokenizer keys hold for ``tok`` (module docstring); refuses, in one
    line, a tokenizer llama.cpp's byte-level BPE cannot reproduce."""
    b2u = {b: c for c, b in _gpt2_byte_decoder().items()}
    if isinstance(tok, ByteTokenizer):
        tokens, merges, special = [b2u[i] for i in range(256)], [f"{b2u[0]} {b2u[0]}"], set()
        pre = "default"
    else:
        spec = json.loads(Path(tok.path).read_text())
        model, pre_tok = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
        if model.get("type") != "BPE" or pre_tok.get("type") != "ByteLevel" or spec.get("normalizer") \
                or pre_tok.get("add_prefix_space") or not pre_tok.get("use_regex", True):
            raise PhaseloopError(f"--format gguf: the run's tokenizer {tok.path} is not a plain byte-level BPE "
                                 f"(model {model.get('type')}, pre-tokenizer {pre_tok.get('type')}), which is all "
                                 "llama.cpp's gpt2 tokenizer reproduces; --format llama carries any tokenizer")
        by_id = {i: t for t, i in model["vocab"].items()}
        special = {a["id"] for a in spec.get("added_tokens") or [] if a.get("special")}
        by_id.update({a["id"]: a["content"] for a in spec.get("added_tokens") or []})
        if sorted(by_id) != list(range(len(by_id))):
            raise PhaseloopError(f"--format gguf: the token ids of {tok.path} have gaps; retrain the tokenizer")
        tokens = [by_id[i] for i in range(len(by_id))]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        merges = merges or [f"{b2u[0]} {b2u[0]}"]
        pre = "gpt-2"
    if len(tokens) > vocab_size:
        raise PhaseloopError(f"--format gguf: the tokenizer has {len(tokens)} tokens, more than the model's "
                             f"vocab_size {vocab_size}")
    n_real = len(tokens)
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(n_real)]
    tokens += [f"[PAD{i}]" for i in range(n_real, vocab_size)]
    types += [gguf.TokenType.UNUSED] * (vocab_size - n_real)
    # llama.cpp stops at the EOS id: the first padding id (never a real token), else byte 0
    eos = n_real if vocab_size > n_real else tokens.index(b2u[0])
    return {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types, "merges": merges, "eos": eos}


def tensor_type(name: str, a: np.ndarray, outtype: str) -> str:
    """The GGUF type a tensor is written in: norms f32; matrices as ``outtype`` (Q8_0 only
    for rows of whole 32-blocks, f16 otherwise)."""
    if a.ndim == 1 or outtype == "f32":
        return "f32"
    if outtype == "q8_0" and a.shape[-1] % 32 == 0:
        return "q8_0"
    return "f16"


def write_gguf(model, tok, path: Path, outtype: str = "f32", name: str = "phaseloop", extra: dict | None = None):
    """Write a Llama ``DecoderLM`` and its tokenizer as a GGUF file at ``path``."""
    if outtype not in OUTTYPES:
        raise PhaseloopError(f"--outtype {outtype}: choose {', '.join(OUTTYPES)}")
    cfg, hp = model.cfg, hyperparameters(model.cfg)
    t = gguf_tokenizer(tok, cfg.vocab_size)
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_name(name)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_block_count(hp["num_hidden_layers"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_dimension_count(hp["head_dim"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_rope_freq_base(hp["rope_theta"])
    w.add_vocab_size(hp["vocab_size"])
    w.add_file_type(FILE_TYPES[outtype])
    for key, value in (extra or {}).items():
        w.add_string(f"phaseloop.{key}", str(value))
    w.add_tokenizer_model(t["model"])
    w.add_tokenizer_pre(t["pre"])
    w.add_token_list(t["tokens"])
    w.add_token_types(t["types"])
    w.add_token_merges(t["merges"])
    w.add_eos_token_id(t["eos"])
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.n_layers)
    for hf_name, tensor in llama_tensors(model).items():
        a = tensor.numpy()
        heads = _heads(hf_name, cfg)
        if heads is not None:
            a = permute(a, heads)
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        kind = tensor_type(gname, a, outtype)
        if kind == "q8_0":
            q = gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), Q8)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=Q8)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32 if kind == "f32" else np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_gguf(path: str | Path) -> tuple[dict, dict]:
    """(metadata: key -> value, tensors: Llama (HF) name -> (fp32 array, GGUF type name)) of
    a file :func:`write_gguf` wrote: Q8_0 dequantised, q/k rows permuted back."""
    r = gguf.GGUFReader(os.fspath(path))
    meta = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            continue
        v = field.contents()
        meta[key] = v
    n_layers, n_heads = meta["llama.block_count"], meta["llama.attention.head_count"]
    n_kv = meta["llama.attention.head_count_kv"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    back = {}
    for i in range(n_layers):
        for part in ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                     "mlp.down_proj"):
            hf = f"model.layers.{i}.{part}.weight"
            back[names.get_name(hf, try_suffixes=(".weight",))] = hf
    for hf in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        back[names.get_name(hf, try_suffixes=(".weight",))] = hf
    tensors = {}
    for t in r.tensors:
        hf = back.get(t.name)
        if hf is None:
            raise PhaseloopError(f"{path}: tensor {t.name} is not one of a Llama's")
        a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        a = a.reshape([int(d) for d in reversed(t.shape)])
        heads = n_heads if hf.endswith("q_proj.weight") else n_kv if hf.endswith("k_proj.weight") else None
        tensors[hf] = (unpermute(a, heads) if heads else a, t.tensor_type.name)
    return meta, tensors


def export_gguf(run: str | Path, out: str | Path, outtype: str = "f32", quantized: str | Path | None = None) -> Path:
    """Write a Llama run as a GGUF file at ``out`` (a new file: an existing one is refused)."""
    out = Path(out)
    if outtype not in OUTTYPES:
        raise PhaseloopError(f"--outtype {outtype}: choose {', '.join(OUTTYPES)}")
    if out.is_dir():
        raise PhaseloopError(f"--out {out} is a folder; --format gguf writes one file: pass a new PATH.gguf")
    if out.suffix != ".gguf":
        raise PhaseloopError(f"--out {out}: a GGUF file is named NAME.gguf (llama.cpp's tools look for it); "
                             "pass --out NAME.gguf")
    if out.exists() or out.is_symlink():
        raise PhaseloopError(f"--out {out} exists; choose a new file (nothing is overwritten)")
    check_out_dir(out.parent)
    model, run_cfg = source_model(run, quantized, "gguf")
    tok = run_tokenizer(run, run_cfg)
    gguf_tokenizer(tok, model.cfg.vocab_size)  # a tokenizer llama.cpp cannot hold: refused before writing
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # removed again on failure
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    ok = False
    try:
        extra = {"run": run_folder(run).resolve(), "model_config_sha256": config_digest(run_cfg["model"]),
                 "quantized": Path(quantized).name if quantized else ""}
        try:
            write_gguf(model, tok, Path(tmp), outtype, run_folder(run).name, extra)
        except OSError as e:  # a full disk: named by the file asked for
            raise OSError(e.errno, e.strerror, os.fspath(out)) from None
        os.chmod(tmp, 0o644)
        publish_new(tmp, out)  # never over a file that appeared meanwhile
        ok = True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        for p in made if not ok else ():
            with contextlib.suppress(OSError):
                p.rmdir()
    return out
