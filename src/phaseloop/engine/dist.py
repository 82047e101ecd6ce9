"""Several processes, launched by torchrun (no home-made launcher): the world a process
belongs to, the few collectives the engine needs, and parallelism applied to a built
model from outside (DDP, or FSDP2 ``fully_shard`` per block with the root last, as
torchtitan does). One process (no torchrun) is a world of size 1 and none of this runs.

Data: the global batch is ``batch_size x grad_accum x world``; each micro-step draws the
windows of all ranks from one generator and rank r takes its slice, so the sequence of
windows is the one a single process would draw at the same global batch, whatever the
world size (``data.TrainBatches``)."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from phaseloop.errors import CheckpointError, first_line
from phaseloop.layers import Block
from phaseloop.trunk import Trunk


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def say(msg: str) -> None:
    """One line on stderr, from rank 0 only in a torchrun world (every rank meets the same
    news at about the same moment)."""
    if world().main:
        print(msg, file=sys.stderr, flush=True)


def launched() -> bool:
    """Started by torchrun (or another launcher setting its variables)?"""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    return World()


def init(device: str = "auto") -> World:
    """Join torchrun's process group once (nccl on CUDA, gloo on CPU); a no-op without
    torchrun. Each process uses the GPU of its local rank."""
    if not launched() or int(os.environ["WORLD_SIZE"]) == 1 or dist.is_initialized():
        return world()
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    minutes = float(os.environ.get("PHASELOOP_DIST_TIMEOUT_MIN", "10"))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=minutes))
    return world()


def close() -> None:
    """Leave the process group. A run's DDP / FSDP2 objects often sit in reference cycles:
    collected first, while the group and the interpreter are alive, instead of at
    interpreter exit, where freeing a gloo work's tensors can abort the process
    ("terminate called without an active exception"; pytorch/pytorch#179291)."""
    if dist.is_available() and dist.is_initialized():
        import gc

        gc.collect()
        dist.destroy_process_group()


def local_device(name: str, w: World) -> str:
    """``auto``/``cuda`` under torchrun mean this rank's GPU."""
    if w.size > 1 and (name == "cuda" or (name == "auto" and torch.cuda.is_available())):
        return f"cuda:{w.local_rank}"
    return name


def barrier() -> None:
    if world().size > 1:
        dist.barrier()


@contextlib.contextmanager
def main_first():
    """Rank 0 does the body first (e.g. builds the token store); the others then do it
    with rank 0's results on disk."""
    w = world()
    if not w.main:
        barrier()
    try:
        yield
    finally:
        if w.main:
            barrier()


def all_sum(*values: torch.Tensor | float) -> list[torch.Tensor]:
    """Sum scalars over the world, in float64, in one collective."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64).detach().cpu().reshape(()) for v in values])
    if world().size > 1:
        backend_cuda = dist.get_backend() == "nccl"
        t = t.cuda() if backend_cuda else t
        dist.all_reduce(t)
        t = t.cpu()
    return list(t.unbind())


def is_peer_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank went away."""
    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        s in text for s in ("gloo", "NCCL", "Connection reset", "Connection closed", "Broken pipe"))


def gather_objects(obj) -> list:
    """Every rank's ``obj`` (on every rank)."""
    w = world()
    if w.size == 1:
        return [obj]
    out = [None] * w.size
    dist.all_gather_object(out, obj)
    return out


def gather_stats(stats: dict) -> dict[str, list[torch.Tensor]]:
    """Every process's tensors of a ``ModelOutput.stats`` (on every process), by name."""
    mine = {k: v.detach().cpu() for k, v in stats.items() if isinstance(v, torch.Tensor)}
    every = gather_objects(mine)
    return {k: [s[k] for s in every if k in s] for k in mine}


@contextlib.contextmanager
def unsharded(model: nn.Module):
    """FSDP2-sharded parameters whole inside the block (every process enters it); DDP or
    one process: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
    try:
        yield model
    finally:
        for m in mods:
            m.reshard()


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, each once however often a trunk applies it."""

    return [m for m in model.modules() if isinstance(m, Block)]


def parallelize(model: nn.Module, how: str, device: torch.device, varying_depth: bool = False) -> nn.Module:
    """The module the training step calls: the model itself in one process, else DDP or
    FSDP2 around it. A weight-shared trunk holds its block once, so it is reduced (DDP)
    or sharded (FSDP2) once however many times it is applied. ``varying_depth`` (training
    for depth): a step may leave parameters unused (a Hyperloop's later loops), which DDP
    must look for (``find_unused_parameters``)."""
    w = world()
    if w.size == 1:
        return model
    if how == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids, find_unused_parameters=varying_depth)
    from torch.distributed.fsdp import fully_shard

    for m in model.modules():  # a data-dependent depth (ACT's early exit) would differ by rank
        if isinstance(m, Trunk):
            m.fix_depth()
    mesh = _mesh(device.type, w.size)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


_MESHES: dict = {}  # (device type, size) -> (the default group it was made in, the mesh)


def _mesh(kind: str, size: int):
    """FSDP2's mesh on the run's device: its default is the machine's accelerator, which would
    move a --device cpu run's parameters to a GPU its gloo group cannot reduce on. One per
    process group (a mesh over another backend than the default group's makes a new group:
    made once, not at every run of a comparison)."""
    from torch.distributed.device_mesh import init_device_mesh

    group = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    have = _MESHES.get((kind, size))
    if have is None or have[0] is not group:
        have = _MESHES[(kind, size)] = (group, init_device_mesh(kind, (size,)))
    return have[1]


@contextlib.contextmanager
def no_sync(module: nn.Module, sync: bool):
    """Skip DDP's gradient all-reduce on micro-batches before the last of a step."""
    if sync or not hasattr(module, "no_sync"):
        yield
    else:
        with module.no_sync():
            yield


# ---------------------------------------------------------------------------- FSDP2 state
def _fqn_order(model: nn.Module, optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_state(model: nn.Module, optimizer, how: str) -> tuple[dict, dict | None]:
    """(model state, optimiser state) unsharded, in the format of one process (the
    optimiser's keyed by parameter index), on rank 0 (empty elsewhere under FSDP2). A
    collective under FSDP2: every rank calls it."""
    if world().size == 1 or how != "fsdp":
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    if optimizer is None:
        return msd, None
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not world().main:
        return {}, {}
    idx = {n: i for i, n in enumerate(_fqn_order(model, optimizer))}
    return msd, {"state": {idx[n]: v for n, v in osd["state"].items()},
                 "param_groups": [{**g, "params": [idx[n] for n in g["params"]]} for g in osd["param_groups"]]}


IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # how, not what, a group steps


def load_optimizer(model: nn.Module, optimizer, state: dict, how: str) -> None:
    """The inverse of ``full_state`` for the optimiser (every rank holds the full state); a
    state of another optimizer's shape (a forged or foreign checkpoint) is one line. The
    implementation this run chose (``optim.adamw``: fused on CUDA, foreach elsewhere) is
    kept over the checkpoint's, which a run started on another device recorded."""
    try:
        own = [{k: g[k] for k in IMPLEMENTATION if k in g} for g in optimizer.param_groups]
        if isinstance(state.get("param_groups"), list) and len(state["param_groups"]) == len(own):
            state = {**state, "param_groups": [{**g, **o} for g, o in zip(state["param_groups"], own)]}
        if world().size == 1 or how != "fsdp":
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        order = _fqn_order(model, optimizer)
        fqn = {"state": {order[int(i)]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, optim_state_dict=fqn,
                                 options=StateDictOptions(full_state_dict=True))
    except (ValueError, KeyError, IndexError) as e:
        raise CheckpointError(f"the checkpoint's optimizer state does not fit this run's optimizer "
                              f"({first_line(e)}): the checkpoint is damaged or foreign; resume from a kept "
                              "checkpoint-* copy or start a new run in another --out") from None


# ---------------------------------------------------------------------------- activation checkpointing
def _checkpointed(forward, *args, **kwargs):
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_activations(model: nn.Module) -> int:
    """Recompute each block's activations in backward instead of storing them
    (``torch.utils.checkpoint``, non-reentrant), applied from outside: each block's
    ``forward`` is wrapped on the instance. Returns the number of blocks wrapped."""
    import functools

    blocks = blocks_of(model)
    for b in blocks:
        if not isinstance(b.forward, functools.partial):
            b.forward = functools.partial(_checkpointed, b.forward)
    return len(blocks)


# ---------------------------------------------------------------------------- throughput
# dense bf16 tensor-core peaks (FLOP/s) by device-name fragment, for MFU
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("GH200", 989e12),
             ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12),
             ("A10G", 70e12), ("A10", 125e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12), ("B200", 2250e12))


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: ``override_tflops`` (``--peak-tflops``), else the table
    for known GPUs, else None (CPUs: no MFU unless told)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16 if k in name), None)


def mfu(tok_per_s: float, flops_per_token: float | None, peak: float | None, world_size: int) -> float | None:
    """Model FLOPs utilisation: 3 x forward FLOPs per token (forward + backward, Kaplan
    et al. 2020) x tokens/s over every device's peak."""
    if not flops_per_token or not peak:
        return None
    return 3 * flops_per_token * tok_per_s / (peak * world_size)
