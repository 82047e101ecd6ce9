"""The trunk interface: what the skeleton, the engine and the exporters may ask of the
part of a model that applies the blocks (``ArchSpec.trunk``).

Every trunk subclasses ``Trunk`` and sets ``depth``; the rest has defaults that a trunk
overrides where it differs (a weight-shared loop, a data-dependent depth).
"""

from __future__ import annotations

from torch import nn

from phaseloop.errors import ConfigError
from phaseloop.layers import Block


class DerivedBuffers:
    """A module holding buffers computed from its config (sinusoids, fixed offsets),
    which a model loaded onto the meta device first must recompute: ``reset_buffers``."""

    def reset_buffers(self) -> None:  # pragma: no cover - the interface
        raise NotImplementedError


def reset_derived_buffers(model: nn.Module) -> None:
    """Recompute every derived buffer of ``model`` (after ``to_empty`` from the meta device)."""
    for m in model.modules():
        if isinstance(m, DerivedBuffers):
            m.reset_buffers()


class Trunk(nn.Module):
    """``forward(x_BTD, ctx) -> x_BTD``; subclasses set ``depth`` in ``__init__``.

    * ``depth``: residual layer applications per token (init scaling, FLOPs, depth matching).
    * ``blocks()``: the distinct blocks, each once however often it is applied (FSDP units).
    * ``set_depth(n)``: run ``n`` applications of the shared block(s) from now on, where the
      architecture allows it (``dynamic_depth``); ``reset_depth()``: back to the depth it was
      built (trained) at; ``fix_depth()``: make the number of block applications independent of
      the input (FSDP needs every rank to apply them equally).
    * ``cache_slots()``: the KV-cache slots one forward may write (``layers.KVCache``).
    * ``compile_targets()``: the (module, method) pairs ``--compile block`` compiles
      (engine/compiling.py): every Block's forward, plus a trunk's per-step extras.
    * ``stream_sites()``: the modules whose output is the residual stream after one layer
      application (a forward hook on each sees every application, in order): the blocks
      by default; trunks that wrap their blocks (hyper-connections) name the wrappers.
    * ``mixing_sites()``: the modules that mix n residual streams, each with a
      ``coefficients(streams) -> (H_pre, H_post, H_res)`` method (hyper-connections;
      ``analysis.probe`` records them); none by default.
    * ``exit_rules``: the ``early_exit`` rules the trunk applies (its loop calls
      ``early_exit.monitor``), set by ``early_exit.set_exit`` into ``exits``;
      ``pass_blocks``: the blocks one pass applies (FLOPs of an exited position);
      ``passes``: the passes a forward runs now (set_depth's n); ``exit_readout(h, ctx, t)``:
      the state h after pass t as the ``kl`` / ``entropy`` rules read it (through the end
      block, ``readout_blocks`` blocks, where the trunk has one; identity by default; a pass
      nobody runs calls it only where ``readout_blocks`` > 0, for its cache slots). A
      pass where no position runs under ``--kv-fill latest`` (``Monitor.idle``) calls
      ``Monitor.idle_pass(x, [(block, slot), ...])``: each ``layers.Block``'s attention
      writes its deepest keys/values into the slot, the blocks are not called (their hooks
      do not fire); a block that caches more than its attention's keys must run instead.
    * ``shares_kv``: the loop names its pass slots through ``kv_slot(i)``, so that
      ``early_exit.set_kv_share`` sets ``kv_share`` (pass i uses slot i mod K).
    * ``program_steps``: > 0 where the trunk halts per position (ACT): an exported program
      then has one method per step, ``program_step(t, ...)``, which the host runs until no
      position runs (deploy/program.py); 0: the program's ``forward`` runs a fixed depth.
    """

    depth: int
    dynamic_depth = False  # set_depth works
    exit_rules: tuple = ()  # none: a stack has no passes to skip
    exits = None  # early_exit.Exits while a rule is set
    pass_blocks = 1
    passes: int | None = None
    readout_blocks = 0
    shares_kv = False
    kv_share: int | None = None
    program_steps = 0

    def kv_slot(self, i: int) -> int:
        """The KV-cache slot index of pass ``i`` (i mod K with ``--kv-share K``, Huginn §6.2)."""
        return i if self.kv_share is None else i % self.kv_share

    def exit_readout(self, h_BTD, ctx, t: int):
        return h_BTD

    def blocks(self) -> list[nn.Module]:
        return [m for m in self.modules() if isinstance(m, Block)]

    def stream_sites(self) -> list[nn.Module]:
        return self.blocks()

    def mixing_sites(self) -> list[nn.Module]:
        return []

    def set_depth(self, n: int, extend: str | None = None) -> None:
        """``extend='last'``: where passes have their own parameters (Hyperloop's loops),
        reuse the last trained pass's beyond the trained count (refused otherwise)."""
        raise ConfigError(f"{type(self).__name__} has a fixed depth; its weights define every layer")

    def compile_targets(self) -> list[tuple[nn.Module, str]]:
        return [(b, "forward") for b in self.blocks()]

    def reset_depth(self) -> None:
        """Run at the depth the trunk was built (trained) at again; a stack always does."""
        if self.dynamic_depth:  # a plugin trunk with set_depth but without its inverse
            raise ConfigError(f"{type(self).__name__} changes its depth (dynamic_depth) but defines no "
                              "reset_depth(); define it to train with depth_sample")

    def fix_depth(self) -> None:
        """Nothing to do for a trunk whose depth never depends on the input."""

    def cache_slots(self) -> list:
        raise NotImplementedError(f"{type(self).__name__} does not list its cache slots")
