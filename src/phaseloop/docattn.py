"""Attention within documents through FlexAttention (Dong et al. 2024,
"Flex Attention: A Programming Model for Generating Optimized Attention Kernels").

A training window that holds several documents (``ForwardContext.doc_ids``, ``--doc-mask``)
attends causally within each document. The portable path is SDPA with a dense
[B, 1, T, T] boolean mask (``layers.Attention._self_keys``), which rules out the fused
causal kernels and holds a T x T mask per row. On CUDA, where torch has
``torch.nn.attention.flex_attention``, ``Attention`` runs ``flex_attention`` compiled
once per process with a ``BlockMask`` built from the document ids (once per forward,
kept on the ForwardContext): blocks that lie wholly in another document are skipped. Dropout
in training (which flex_attention lacks) keeps the SDPA path.

The CPU tests run this path through eager ``flex_attention`` (the same mask and call;
only the compiled kernel differs) and check it equals the SDPA path within 1e-5 in
float32 (tests/test_documents.py). The compiled CUDA kernel is PyTorch's.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _flex():
    """torch.nn.attention.flex_attention, or None where this torch lacks it."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def wanted(q: torch.Tensor, dropout_p: float) -> bool:
    """Whether a document-masked attention over ``q`` runs through FlexAttention."""
    return q.is_cuda and dropout_p == 0.0 and _flex() is not None


def block_mask(doc_ids_BT: torch.Tensor):
    """The BlockMask of causal attention within each document of ``doc_ids_BT`` [B, T]."""
    fa = _flex()

    def within_document(b, h, q_idx, kv_idx):
        return (doc_ids_BT[b, q_idx] == doc_ids_BT[b, kv_idx]) & (q_idx >= kv_idx)

    B, T = doc_ids_BT.shape
    return fa.create_block_mask(within_document, B, None, T, T, device=doc_ids_BT.device)


@functools.cache
def _compiled():
    return torch.compile(_flex().flex_attention, dynamic=False)


def attend(q_BHTE: torch.Tensor, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, mask, gqa: bool) -> torch.Tensor:
    """flex_attention over ``mask`` (``block_mask``): compiled on CUDA, eager elsewhere."""
    fn = _compiled() if q_BHTE.is_cuda else _flex().flex_attention
    return fn(q_BHTE, k_BKTE, v_BKTE, block_mask=mask, enable_gqa=gqa)
