"""A pass over only the positions still running (an early exit that skips work, docs/inference.md).

``Running`` is what a trunk's loop puts into ``ForwardContext.running`` for one pass: which
positions of the forward's [B, T] still compute, and how the others' keys/values at this
pass are filled (``fill``):

* ``recompute`` — projected from the exited position's frozen state (its layer input
  at this pass): the masked full pass's semantics (CALM's state propagation, Schuster
  et al. 2022 §3.3), at the cost of the keys/values (counted by ``analysis.exits``);
* ``latest`` — the deepest keys/values the position computed, nothing projected
  (Huginn, Geiping et al. 2025, arXiv 2502.05171 §6).

``layers.Block`` then runs attention queries, the output projection and the FFN on the
running rows only (gathered into [N, D]); the running queries attend to the keys of every
position at this pass (their own fresh ones, the exited ones' by ``fill``), each row causally
through a padded [B, Tq] layout. An exited row leaves every layer unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

FILLS = ("recompute", "latest")


@dataclass
class Running:
    """mask [B, T] of the positions this pass computes; ``latest``: per attention module,
    the deepest (keys, values) [B, T, K, E] of this forward's positions (``fill=latest``)."""

    mask: torch.Tensor
    fill: str = "recompute"
    latest: dict = field(default_factory=dict)

    def __post_init__(self):
        B, T = self.mask.shape
        counts_B = self.mask.sum(1)
        # host reads where some positions stopped: this count, the longest row, and the
        # boolean index and nonzero below (sizes the gathered rows need); none for ``uniform``
        self.n = int(counts_B.sum())
        self.any, self.all = self.n > 0, self.n == B * T
        if self.any and not self.all:
            Tq = int(counts_B.max())
            # each row's running positions first, in order (a stable sort of "exited")
            self.qpos_BQ = torch.sort((~self.mask).to(torch.int8), dim=1, stable=True).indices[:, :Tq]
            self.qvalid_BQ = torch.arange(Tq, device=self.mask.device) < counts_B[:, None]
            rows_BQ = torch.arange(B, device=self.mask.device)[:, None] * T + self.qpos_BQ
            self.flat_N = rows_BQ[self.qvalid_BQ]  # running positions of B*T, row-major
            self.qflat_N = self.qvalid_BQ.flatten().nonzero().squeeze(1)  # their slots in B*Tq

    @classmethod
    def uniform(cls, mask: torch.Tensor, fill: str, latest: dict, running: bool) -> Running:
        """Every position of ``mask`` running (``running``) or none, as the caller knows:
        no reduction and no host read."""
        out = object.__new__(cls)
        B, T = mask.shape
        out.mask, out.fill, out.latest, out.n = mask, fill, latest, B * T if running else 0
        out.any, out.all = out.n > 0, out.n == B * T
        return out

    def with_fill(self, fill: str, latest: dict) -> Running:
        """The same positions under another fill (readouts keep their own latest keys)."""
        other = object.__new__(Running)
        other.__dict__.update(self.__dict__, fill=fill, latest=latest)
        return other

    def gather(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """[N, ...] the running rows of [B, T, ...]."""
        return x_BTD.flatten(0, 1).index_select(0, self.flat_N)

    def scatter(self, x_BTD: torch.Tensor, rows_ND: torch.Tensor) -> torch.Tensor:
        """``x_BTD`` with its running rows replaced by ``rows_ND``."""
        return x_BTD.flatten(0, 1).index_copy(0, self.flat_N, rows_ND.to(x_BTD.dtype)).view_as(x_BTD)

    def pad(self, rows_N: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [B, Tq, ...] (each row's running positions first; the rest zeros)."""
        B, Tq = self.qvalid_BQ.shape
        out = rows_N.new_zeros(B * Tq, *rows_N.shape[1:])
        return out.index_copy(0, self.qflat_N, rows_N).view(B, Tq, *rows_N.shape[1:])

    def unpad(self, x_BQ: torch.Tensor) -> torch.Tensor:
        return x_BQ.flatten(0, 1).index_select(0, self.qflat_N)

    def mask_BQS(self, past: int, S: int, doc_ids_BT: torch.Tensor | None = None,
                 key_mask_B1TS: torch.Tensor | None = None) -> torch.Tensor:
        """bool [B, 1, Tq, S]: a running query at position i sees the keys 0 .. past + i
        (within its document with ``doc_ids``; within its row's own columns with the
        ``key_mask`` of left-padded rows); padded queries see key 0 only. Built once per
        pass (every layer of it attends alike)."""
        key = (past, S, doc_ids_BT is not None, id(key_mask_B1TS))
        if getattr(self, "_mask_key", None) != key:
            self._mask_key, self._mask = key, self._build_mask(past, S, doc_ids_BT, key_mask_B1TS)
        return self._mask

    def _build_mask(self, past: int, S: int, doc_ids_BT, key_mask_B1TS) -> torch.Tensor:
        keys_S = torch.arange(S, device=self.mask.device)
        ok = keys_S[None, None, :] <= (past + self.qpos_BQ)[:, :, None]
        if doc_ids_BT is not None:  # no cache with documents: S = T
            ok = ok & (doc_ids_BT[:, None, :] == doc_ids_BT.gather(1, self.qpos_BQ)[:, :, None])
        if key_mask_B1TS is not None:  # the rows of a continuous batch (decoding.padded_rows)
            ok = ok & key_mask_B1TS[:, 0].gather(1, self.qpos_BQ[:, :, None].expand(-1, -1, S))
        ok = torch.where(self.qvalid_BQ[:, :, None], ok, keys_S[None, None, :] == 0)
        return ok[:, None]


def rope_rows(cos_TE: torch.Tensor, run: Running, T: int) -> torch.Tensor:
    """[N, 1, E] RoPE table rows of the running positions, from [T, E] or [B, 1, T, E]."""
    if cos_TE.dim() == 2:
        return cos_TE.index_select(0, run.flat_N % T)[:, None]
    return cos_TE[:, 0].flatten(0, 1).index_select(0, run.flat_N)[:, None]


def merged_kv(attn, run: Running, fresh_NKE: tuple) -> None:
    """Keep in ``run.latest`` the (keys, values) [B, T, K, E] of this pass under
    ``fill=latest``: the running rows' fresh ones, the others' deepest (``deepest_kv``
    reads them, this pass and the next)."""
    old = run.latest[id(attn)]
    out = tuple(o.flatten(0, 1).index_copy(0, run.flat_N, f.to(o.dtype)).view_as(o) for o, f in zip(old, fresh_NKE))
    run.latest[id(attn)] = out


def deepest_kv(attn, run: Running) -> tuple:
    """(keys, values) [B, K, T, E] of ``attn`` under ``fill=latest``: every position's
    deepest of this forward (``merged_kv``'s last, or the last pass every position ran)."""
    k_BTKE, v_BTKE = run.latest[id(attn)]
    return k_BTKE.transpose(1, 2), v_BTKE.transpose(1, 2)
