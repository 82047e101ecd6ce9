"""The KV cache every model decodes with: keys/values per *slot*, one slot per application
of an attention layer (layer i of a stack; (layer, pass) of a weight-shared block, or
(layer, pass mod K) when passes share their slots: ``--kv-share K``, Huginn §6.2).

Contracts the trunks rely on:

* A slot written for the first time in a forward (``pos`` unchanged since) appends its
  new rows; written again in the same forward (a shared slot: passes i and i + K) its
  last rows are replaced by the new ones, which always end at the newest position.
* ``truncate(n)`` drops every position >= n (speculative decoding rolls back rejected
  drafts); an entry that is not a (keys, values) pair rolls back through its own
  ``truncate(n)`` or is refused by name.
* ``owe(slot, k, v)``: rows no query reads before the slot is next written, copied in only
  then or when ``entries`` is read (a skipped pass's keys/values: ``early_exit``).
* ``nbytes``: the bytes of the keys/values and other entries the cache holds (preallocated
  buffers counted whole), what ``generate --json`` reports as ``kv_cache_bytes``; its
  position tables (``position_table``, derived from positions alone) are not counted.

Shapes: B batch, K kv heads, T new positions, E head dim.

``StaticKVCache``: module buffers of fixed shape [B, K, max_len, E] per slot, written in
place at the new tokens' positions; attention reads the whole buffer under a mask of the
positions written so far. A model's whole decoding state is then buffers, as torch.export
and ExecuTorch's LLM runner need (the cache in module buffers, ``forward(tokens,
input_pos)``); eager phaseloop runs with it too, and equals ``KVCache``
(tests/test_static_cache.py, float64 to 1e-10).
"""

from __future__ import annotations

import torch
from torch import nn

from phaseloop.errors import ConfigError

OWED = 64  # forwards a slot's owed rows wait at most (they hold their own tensors meanwhile)
PREALLOCATE = 8192  # positions a KVCache preallocates per slot at most (beyond: grown, doubling)


def _pair(entry) -> bool:
    return isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(t, torch.Tensor) for t in entry)


class KVCache:
    """``pos``: absolute position of the next token, or with ``pad`` (rows of a continuous
    batch, ``decoding.join_rows``) the next column: row b's first ``pad[b]`` columns are
    padding, column j holds its position j - pad[b].

    ``owe(slot, k, v)`` takes rows no query reads before the slot is written again: the
    keys/values of a pass every position skipped (``--kv-fill``, ``Monitor.idle_pass``).
    They are written when ``update`` next writes that slot, or when ``entries`` is read
    (then every slot's), so a decode whose tokens exit after one pass copies nothing into
    the later passes' slots; what the cache holds once read is what ``update`` would have
    written, bit for bit."""

    static = False  # keys of the tokens so far only, no mask needed

    def __init__(self, entries: dict | None = None, pos: int = 0, pad: torch.Tensor | None = None,
                 capacity: int | None = None):
        self._entries = {} if entries is None else entries
        self.pos, self.pad = pos, pad  # pad: [B] leading padding columns per row; None: no padding
        # positions to preallocate per slot: keys/values are then written in place into one
        # buffer (``entries`` holds views of its filled part) instead of grown by torch.cat;
        # None: grown. A slot that outgrows it doubles its buffer. At most PREALLOCATE positions
        # up front: a request for millions of new tokens grows as it is written instead of
        # asking for the memory of all of them before the first forward
        self.capacity = capacity if capacity is None else min(capacity, PREALLOCATE)
        self.buffers: dict = {}
        # slot -> pos at its latest write: written again at the same pos = in the same forward
        # (whoever moves pos back, truncate or decoding.keep_rows, clears it)
        self.written: dict = {}
        # position tables (RoPE's cos/sin, UT's timing signal) over positions 0 .. n - 1, made
        # once per decode and sliced by each forward (``position_table``)
        self.tables: dict = {}
        self.owed: dict = {}  # slot -> [(k_BKTE, v_BKTE), ...] rows taken by ``owe``, not yet written

    @property
    def entries(self) -> dict:
        """slot -> (keys, values) [B, K, S, E], or a trunk's own state; every owed row written."""
        for slot in list(self.owed):
            self._settle(slot)
        return self._entries

    def update(self, slot, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor):
        """Write the new rows of ``slot`` (appended, or replacing its last rows when the
        slot was written already in this forward) and return its whole (keys, values)."""
        self._settle(slot)
        T = k_BKTE.shape[2]
        n = self._entries[slot][0].shape[2] if slot in self._entries else 0
        start = n - T if self.written.get(slot) == self.pos else n
        if start < 0:
            raise ValueError(f"KV slot {slot!r}: {T} rows replace more than the {n} it holds")
        self.written[slot] = self.pos
        return self._write(slot, k_BKTE, v_BKTE, start, n)

    def owe(self, slot, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor) -> None:
        """``update`` without the copy: the rows are written when the slot is next updated
        or ``entries`` read (at most ``OWED`` forwards later). Only for rows no query reads
        before then, and tensors nobody changes in place."""
        if self.written.get(slot) == self.pos:  # replacing rows of this forward: at once
            self.update(slot, k_BKTE, v_BKTE)
            return
        self.written[slot] = self.pos
        rows = self.owed.setdefault(slot, [])
        rows.append((k_BKTE, v_BKTE))
        if len(rows) >= OWED:
            self._settle(slot)

    def _settle(self, slot) -> None:
        """Append the rows owed to ``slot`` (in the order they were owed)."""
        rows = self.owed.pop(slot, None)
        if rows:
            k_BKTE, v_BKTE = (t[0] if len(t) == 1 else torch.cat(t, dim=2) for t in zip(*rows))
            n = self._entries[slot][0].shape[2] if slot in self._entries else 0
            buf = self.buffers.get(slot)
            size, end = (0 if buf is None else buf[0].shape[2]), n
            for k, _ in rows:  # the buffer each write in turn would have grown to: the same bytes held
                end += k.shape[2]
                size = size if end <= size else max(self.capacity or 0, 2 * end if size else end)
            self._write(slot, k_BKTE, v_BKTE, n, n, size)

    def _write(self, slot, k_BKTE, v_BKTE, start: int, n: int, size: int = 0):
        """Rows [start, start + T) of ``slot``, which holds ``n``, into a buffer of at least
        ``size`` positions; returns its whole (keys, values)."""
        T = k_BKTE.shape[2]
        end = max(n, start + T)
        if self.capacity is None:
            self.buffers.pop(slot, None)  # grown from now on: a buffer would go stale
            if n and start < n:  # replace rows [start, start + T), keep any after them
                k_old, v_old = self._entries[slot]
                k_BKTE = torch.cat([k_old[:, :, :start], k_BKTE, k_old[:, :, start + T:]], dim=2)
                v_BKTE = torch.cat([v_old[:, :, :start], v_BKTE, v_old[:, :, start + T:]], dim=2)
            elif n:
                k_old, v_old = self._entries[slot]
                k_BKTE, v_BKTE = torch.cat([k_old, k_BKTE], dim=2), torch.cat([v_old, v_BKTE], dim=2)
            self._entries[slot] = (k_BKTE, v_BKTE)
            return self._entries[slot]
        buf = self.buffers.get(slot)
        if buf is None or end > buf[0].shape[2]:
            size = size or max(self.capacity, 2 * end if buf is not None else end)
            B, K, _, E = k_BKTE.shape
            new = (k_BKTE.new_empty(B, K, size, E), v_BKTE.new_empty(B, K, size, E))
            if n:
                new[0][:, :, :n], new[1][:, :, :n] = self._entries[slot]
            buf = self.buffers[slot] = new
        buf[0].narrow(2, start, T).copy_(k_BKTE)  # narrow: one op where [:, :, a:b] is three
        buf[1].narrow(2, start, T).copy_(v_BKTE)
        self._entries[slot] = (buf[0].narrow(2, 0, end), buf[1].narrow(2, 0, end))
        return self._entries[slot]

    @property
    def origin(self) -> int:
        """The position of the first cached row (``pos`` less the longest slot's rows)."""
        return self.pos - max((e[0].shape[2] for e in self.entries.values() if _pair(e)), default=0)

    def truncate(self, n: int) -> None:
        """Forget every position >= ``n`` (origin <= n <= pos), as if they were never fed."""
        origin = self.origin
        if not origin <= n <= self.pos:
            raise ValueError(f"cannot truncate the cache to position {n}: it holds {origin} .. {self.pos - 1}")
        if self.pad is not None:
            raise ValueError("cannot truncate the rows of a continuous batch (left-padded rows)")
        keep = n - origin
        for slot, entry in list(self.entries.items()):
            if _pair(entry):
                self.entries[slot] = tuple(t[:, :, :keep] for t in entry)
            elif hasattr(entry, "truncate"):
                rest = entry.truncate(n)
                if rest is None:
                    del self.entries[slot]
                else:
                    self.entries[slot] = rest
            else:
                raise ConfigError(f"the KV cache entry {slot!r} (a running summary, not keys and values) "
                                  "cannot be rolled back to an earlier position")
        self.written.clear()
        self.pos = n

    def select_rows(self, idx_R: torch.Tensor) -> None:
        """Keep rows ``idx_R`` of every entry, in that order (beam search reorders)."""
        entries = self.entries  # every owed row written into the buffers first
        self.pad = None if self.pad is None else self.pad.index_select(0, idx_R)
        self.buffers = {s: tuple(t.index_select(0, idx_R) for t in buf) for s, buf in self.buffers.items()}
        for slot, entry in entries.items():
            if slot in self.buffers:
                n = entry[0].shape[2]
                self.entries[slot] = tuple(t[:, :, :n] for t in self.buffers[slot])
            elif hasattr(entry, "select_rows"):
                self.entries[slot] = entry.select_rows(idx_R)
            else:  # (keys, values), or a list of tensors
                self.entries[slot] = type(entry)(t.index_select(0, idx_R) for t in entry)

    @property
    def nbytes(self) -> int:
        """Bytes of every entry's tensors: a slot's whole buffer where preallocated (the
        position ``tables`` not counted; owed rows written first)."""
        entries = self.entries
        total = sum(t.nbytes for buf in self.buffers.values() for t in buf)
        for slot, entry in entries.items():
            if slot in self.buffers:
                continue
            if hasattr(entry, "nbytes"):
                total += entry.nbytes
            else:
                total += sum(t.nbytes for t in (entry if isinstance(entry, (tuple, list)) else [entry])
                             if isinstance(t, torch.Tensor))
        return total


def position_table(cache, key, start: int, T: int, device, make):
    """``make(positions)`` of positions start .. start + T - 1. With a ``KVCache``, sliced from
    ``make`` of 0 .. n - 1 kept in ``cache.tables[key, device]`` (n: the cache's capacity,
    doubled when outgrown): a decoded token's tables cost a slice instead of a dozen small
    ops. ``make`` must be elementwise in the positions (row i depends on position i alone),
    so a slice equals the tables made anew; without a cache, with a static one and while
    compiling they are made anew."""
    if cache is None or cache.static or torch.compiler.is_compiling():
        return make(torch.arange(start, start + T, device=device))
    have = cache.tables.get((key, device))
    n = 0 if have is None else have[0].shape[0]
    if start + T > n:
        n = max(cache.capacity or 0, 2 * n, start + T)
        made = make(torch.arange(n, device=device))
        have = cache.tables[key, device] = made if isinstance(made, tuple) else (made,)
    out = tuple(t[start:start + T] for t in have)
    return out if len(out) > 1 else out[0]


class StaticKVCache(nn.Module):
    """Keys/values per slot in buffers preallocated for ``max_len`` positions
    (``k<i>`` / ``v<i>``, [batch, K, max_len, E], zeros), written at the new tokens'
    positions with ``index_copy_``. Key j is visible to the query at position p iff
    j <= p (``visible``), so positions never written are masked, whatever they hold.

    ``DecoderLM.forward(idx, cache=c)`` takes the new tokens' positions from
    ``positions_BT`` (the exported program's ``input_pos``; a later call may rewrite
    earlier positions: a new sequence restarts at 0) or else from ``pos``, which it
    advances, as with ``KVCache``. A slot's buffers are made at its first update, so one
    eager forward allocates them all before torch.export sees the module. The cache holds
    keys and values only: a trunk keeping other state in ``entries`` is refused by name.
    """

    static = True
    pad = None  # rows are never left-padded (KVCache.pad)

    def __init__(self, max_len: int, batch: int = 1):
        super().__init__()
        if not isinstance(max_len, int) or max_len < 1:
            raise ConfigError(f"StaticKVCache(max_len={max_len!r}): need a positive number of positions")
        self.max_len, self.batch, self.pos = max_len, batch, 0
        self.slots: dict = {}  # slot -> its buffers' index, in first-use order

    @property
    def entries(self):
        raise ConfigError("this model keeps state other than keys and values in its cache (cache.entries); "
                          "a static cache (torch.export, ExecuTorch) holds keys and values only")

    def positions(self, B: int, T: int, device) -> torch.Tensor:
        """[B, T]: positions pos .. pos + T - 1, checked against ``max_len`` and the batch."""
        if B != self.batch:
            raise ConfigError(f"a StaticKVCache for batch {self.batch} got a batch of {B}; build one per batch size")
        if self.pos + T > self.max_len:
            raise ConfigError(f"{self.pos + T} positions exceed the static cache's max_len={self.max_len}; "
                              "start a new sequence (a new cache, or positions from 0) or raise max_len")
        return torch.arange(self.pos, self.pos + T, device=device).expand(B, T)

    def update(self, slot, k_BKTE: torch.Tensor, v_BKTE: torch.Tensor, positions_BT: torch.Tensor):
        """Write the new keys/values at ``positions_BT[0]`` (every row decodes the same
        positions); returns (keys [B, K, max_len, E], values, visible [B, 1, T, max_len])."""
        i = self.slots.get(slot)
        if i is None:
            i = self.slots[slot] = len(self.slots)
            B, K, _, E = k_BKTE.shape
            for name in ("k", "v"):
                self.register_buffer(f"{name}{i}", k_BKTE.new_zeros(B, K, self.max_len, E), persistent=False)
        keys, values = getattr(self, f"k{i}"), getattr(self, f"v{i}")
        pos_T = positions_BT[0]
        keys.index_copy_(2, pos_T, k_BKTE.to(keys.dtype))
        values.index_copy_(2, pos_T, v_BKTE.to(values.dtype))
        visible_BTS = torch.arange(self.max_len, device=pos_T.device)[None, None, :] <= positions_BT[:, :, None]
        return keys, values, visible_BTS[:, None]

    def reset(self) -> None:
        """Empty again (zeros; position 0), keeping the buffers."""
        self.pos = 0
        for b in self.buffers():
            b.zero_()
