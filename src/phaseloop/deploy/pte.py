"""A ``RunnerProgram`` as the bytes of an ExecuTorch ``.pte``: torch.export (T dynamic, 1 ..
max_len), low-bit weights through torchao, lowering to XNNPACK (or the portable kernels
alone) and constant methods for the runner's metadata (``run.py`` writes the file,
``runtime.PteModel`` runs it).

Weights (``--bits``): every ``nn.Linear`` but the LM head (with ``--head`` the head too; the
embedding is a lookup and stays fp32) as
torchao's ``Int8DynamicActivationIntxWeightConfig``, which XNNPACK runs as integer
GEMMs: 8 bits per output channel (``PerAxis(0)``), or 4 bits in groups of 32 input
columns (``PerGroup(32)``; a layer whose width 32 does not divide stays fp32), with
activations quantised to int8 per token at run time. Not ``Int8WeightOnlyConfig``: it
lowers, but XNNPACK's delegate then computes wrong logits without a word
(tests/test_deploy_runtime.py checks a quantised file against its dequantised reference).
"""

from __future__ import annotations

import warnings

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass
from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
from torch import nn
from torch.export import Dim, export
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
from torchao.quantization.granularity import PerAxis, PerGroup

from phaseloop.deploy.program import RunnerProgram, step_methods
from phaseloop.errors import ConfigError

BITS = (8, 4)
GROUP = 32  # input columns per int4 scale
BACKENDS = ("xnnpack", "portable")


def quantize_linears(program: RunnerProgram, bits: int, head: bool = False) -> list[str]:
    """Quantise ``program``'s Linears in place (see the module docstring); returns their names.
    ``head``: the LM head too (``export --head``, as ``quantize --head`` and llama.cpp's
    types do: a decode step's largest single read); a head tied to the embedding is refused."""
    if bits not in BITS:
        raise ConfigError(f"--bits {bits}: choose 8 or 4")
    lm_head = program.model.head
    if head and program.model.cfg.tie_embeddings:
        raise ConfigError("--head: this run's head is tied to its embedding, so quantising it would quantise "
                          "the embedding too; export without --head")
    taken = [name for name, m in program.named_modules() if isinstance(m, nn.Linear)
             and (head or m is not lm_head) and (bits == 8 or m.in_features % GROUP == 0)]
    granularity = PerAxis(0) if bits == 8 else PerGroup(GROUP)
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int8 if bits == 8 else torch.int4,
                                                   weight_granularity=granularity)
    quantize_(program, config, filter_fn=lambda m, fqn: fqn in taken)
    return taken


def lower(program: RunnerProgram, meta: dict, backend: str = "xnnpack") -> bytes:
    """The ``.pte`` bytes of ``program`` (its cache empty; quantised already, or not): ``forward``
    and, for a trunk that halts per position, the host-driven step methods (program.py) on
    the same cache buffers (``share_mutable_buffers``)."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend {backend!r}: choose {' or '.join(BACKENDS)}")
    program.cache.reset()
    T = Dim("T", min=1, max=program.max_len)
    n = min(2, program.max_len)
    methods = {"forward": (program, (torch.zeros(1, n, dtype=torch.long), torch.arange(n)), (1, 0)),
               **step_methods(program)}
    with torch.no_grad(), warnings.catch_warnings():  # no grad: the lowering refuses a mutated
        # buffer that requires it; torch.export's own pytree deprecation, raised inside it
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)
        exported = {}
        for name, (module, example, dims) in methods.items():
            try:
                exported[name] = export(module, example, dynamic_shapes=tuple({d: T} for d in dims), strict=False)
            except Exception as e:  # e.g. a plugin's data-dependent Python branch
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise ConfigError(f"torch.export cannot trace this {program.model.cfg.arch} model: {first}") from None
        partitioner = [XnnpackPartitioner()] if backend == "xnnpack" else []
        edge = to_edge_transform_and_lower(exported, partitioner=partitioner, constant_methods=meta)
        if len(exported) == 1:
            config = ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(["cache"])])
        else:  # the methods read and write one set of cache buffers
            config = ExecutorchBackendConfig(passes=[_InitUsedCache()], emit_mutable_buffer_names=True,
                                             memory_planning_pass=MemoryPlanningPass(share_mutable_buffers=True))
        return edge.to_executorch(config).buffer


class _InitUsedCache(PassBase):
    """``InitializedMutableBufferPass(["cache"])`` for the cache buffers a method uses only:
    each method carries the initial state (zeros) of the buffers it marks, and every method
    lists every cache buffer. ``forward`` zeros them all when it loads; ``act_step_<t>`` its
    own step's slot, which no method wrote before it loaded (21.1 MB of zeros against
    2.4 MB at universal-act-small: docs/deploy.md)."""

    def call(self, gm):
        for node in gm.graph.nodes:
            if node.op == "placeholder" and "cache" in node.name and node.users:
                node.meta["et_init_buffer"] = True
        return PassResult(gm, False)
