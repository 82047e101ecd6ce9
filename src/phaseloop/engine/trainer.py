"""The one training loop: LM runs (``phaseloop.lm.train``), task runs (``tasks``) and the
comparison runner all go through ``Trainer``.

The Trainer owns the three things a resumable (and, later, distributed) run must agree
on: the model (seeded, built and placed by it), the optimiser and the data order (the
``batches`` object, whose state goes into every checkpoint). What differs between runs
is passed in: how to build the model, where batches come from, how a batch becomes a
loss (``loss_fn(model, batch, device) -> ModelOutput``; auxiliary losses such as the ACT
ponder cost travel in ``ModelOutput.aux_losses`` and are logged apart) and, optionally,
an evaluation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from phaseloop import registry
from phaseloop.depth import check_depth_sample, parse_depth_range, sampled_depth
from phaseloop.engine import compiling, dist, progress
from phaseloop.engine.checkpoint import (
    data_state,
    load_model_state,
    load_trainer_state,
    optimizer_state,
    remove_orphans,
    rng_states,
    save_checkpoint,
)
from phaseloop.engine.config import TrainConfig
from phaseloop.engine.flops import FlopCount
from phaseloop.engine.initfrom import load_init
from phaseloop.engine.keep import Keeper
from phaseloop.engine.optim import autocast, check_memory, lr_at, make_optimizer, peak_memory_mb, resolve_device, tf32
from phaseloop.engine.run import RunFolder
from phaseloop.engine.trackers import Trackers
from phaseloop.engine.trackers import check as check_trackers
from phaseloop.engine.weighting import step_batches, step_loss
from phaseloop.errors import PhaseloopError


class DivergedError(PhaseloopError):
    """A non-finite loss or gradient beyond the ``skip_nonfinite`` budget (exit 3)."""


class PeerFailed(PhaseloopError):
    """Another process of the torchrun world died or failed mid-collective (exit 4)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM turned into it) during training: where it stopped, and the
    step of the last checkpoint on disk (None: none was written)."""

    def __init__(self, step: int, saved: int | None):
        super().__init__(step, saved)
        self.step, self.saved = step, saved


class Batches(Protocol):
    """A seeded source of training batches whose position can be saved and restored."""

    def next(self): ...

    def state(self) -> dict[str, torch.Tensor]: ...

    def set_state(self, state: dict[str, torch.Tensor]) -> None: ...


class Trainer:
    """Train ``build()``'s model on ``batches`` for ``tc.steps`` optimiser steps:
    ``Trainer(...)`` holds the parts, ``setup()`` builds the model, optimiser and state
    (resuming a checkpoint), ``fit()`` runs (setting up first if needed).

    Each step: lr from ``tc.schedule``, ``grad_accum`` micro-batches (loss / grad_accum
    backpropagated under autocast; targets equal to ``tc.loss_ignore_id`` left out),
    gradient clipping, a step of ``tc.optimizer``. Every ``log_every`` steps a record
    (loss = mean cross-entropy of the step's micro-batches, aux losses, lr, grad norm,
    tokens, tokens/s, training time) goes to ``records``, the run's metrics.jsonl and
    ``on_step(step, record)``; every ``eval_every`` steps ``evaluate(model)``'s dict
    is logged; every ``ckpt_every`` steps (and at the end) a checkpoint is written. With
    ``run`` None nothing is written (an in-memory run).

    A step whose loss or gradient norm is not finite is never applied: it is skipped
    while ``tc.skip_nonfinite`` allows (counted in ``skipped_steps``), else the run stops
    with ``DivergedError``, the last checkpoint as it was. That check costs one host
    sync a step."""

    def __init__(self, build: Callable[[], nn.Module], tc: TrainConfig, batches: Batches,
                 loss_fn: Callable, *, evaluate: Callable[[nn.Module], dict] | None = None,
                 run: RunFolder | None = None, progress: bool = False, desc: str = "train",
                 on_step: Callable[[int, dict], None] | None = None,
                 flops_per_token: float | Callable[[int | None], float | None] | None = None,
                 compile_share: int = 1,
                 log: Callable[[str], None] | None = None):
        """Store what the run is made of; nothing is built or written until ``setup``.
        ``compile_share``: the runs, this one included, that will compile the same blocks
        (a comparison's; ``compiling.shares``): ``--compile auto`` splits one compile between them.
        ``log``: where notes go (what ``--init-from`` changes), rank 0 only; None: nowhere.
        ``flops_per_token``: forward FLOPs per token for MFU, a number or a function of a
        step's depth (``tc.depth_sample``; None: the trained depth), asked once per depth."""
        self.compile_share, self.log = compile_share, log
        self.build, self.tc, self.batches, self.loss_fn, self.evaluate = build, tc, batches, loss_fn, evaluate
        self.flops = FlopCount(flops_per_token)  # forward FLOPs of the tokens trained, per step's depth
        self.run, self.progress, self.desc, self.on_step = run, progress, desc, on_step
        self.world = dist.world()
        self.device = resolve_device(dist.local_device(tc.device, self.world))
        self.step, self.elapsed, self.tokens, self.skipped, self.unlogged = 0, 0.0, 0, 0, 0.0
        self.saved: int | None = None  # step of the checkpoint on disk
        self.ran = 0  # steps run by this process (0 when resuming a finished run)
        self.records, self.last_eval = [], {}  # the logged records; the last evaluation
        self.stats: dict = {}  # the last micro-batch's ModelOutput.stats (ACT ponder times)
        self.trackers = Trackers()  # --log-to: opened by fit, in the process that writes the run
        self._ready = False

    def __getattr__(self, name: str):  # only called for attributes not set yet
        if name in ("model", "fwd", "optimizer", "peak"):
            raise AttributeError(f"Trainer.{name} exists once setup() has run (fit() runs it)")
        raise AttributeError(name)

    def setup(self) -> Trainer:
        """Build the model (seeded, checked against the device's memory first), place and
        parallelise it, make the optimiser, restore a checkpoint being resumed and start
        the run folder. Runs once; ``fit`` calls it."""
        if self._ready:
            return self
        tc, run = self.tc, self.run
        tc.check()
        with torch.device("meta"):  # refuse what cannot fit (or train at its depths) before allocating it
            check_memory(twin := self.build(), self.device, 16, "training")
            if tc.depth_sample is not None:
                check_depth_sample(twin, parse_depth_range(tc.depth_sample), tc.extend_loops)
            for m in twin.modules():  # a module's own refusals of these settings (e.g. documents)
                if hasattr(m, "check_training"):
                    m.check_training(tc)
        self.keeper = Keeper(run.path if run is not None else None, tc.keep_checkpoints, tc.keep_best, self.writes)
        if run is not None:
            run.check()
            self.keeper.check()  # a damaged best is refused before the folder changes
            check_trackers(tc.log_to, run.path)  # a missing package or damaged ids: refused before any write
        torch.manual_seed(tc.seed)  # the same initial weights on every rank
        self.model = self.build().to(self.device)
        if self.world.rank > 0:  # dropout masks differ between ranks
            self._seed_rank(0)
        self.flops.at(None)  # counted here, not during the first step
        ckpt = run.checkpoint if run is not None else None
        restored = self._restore_model(ckpt) if ckpt is not None else None
        if restored is None and tc.init_from is not None:  # a new run from another run's weights
            load_init(self.model, tc.init_from, self.log if self.world.main else None)
        if tc.checkpoint_activations:  # before FSDP2 wraps the blocks, as torchtitan does
            dist.checkpoint_activations(self.model)
        meta = restored[0] if restored is not None else {}
        self.compiler = compiling.RunCompiler(  # block mode compiles before DDP / FSDP2 wrap
            tc.compile, self.model, self.device, compiling.batch_key(tc), meta.get("compile"),
            sharded=self.world.size > 1 and tc.parallel == "fsdp", main=self.world.main,
            verbose=self.progress, share=self.compile_share, probe=meta.get("compile_probe"))
        self.fwd = dist.parallelize(self.model, tc.parallel, self.device,  # from outside the model
                                    varying_depth=tc.depth_sample is not None)
        self.compiler.attach(self.fwd)
        self.peak = dist.peak_flops(self.device, tc.peak_tflops)
        self.optimizer = make_optimizer(self.model, tc)  # after FSDP2 made its parameters DTensors
        if restored is not None:
            self._restore(*restored)
        if run is not None and self.world.main:
            run.start(self.step)
        dist.barrier()
        self.keeper.sync(self.step)
        self._ready = True
        return self

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's files (rank 0 of a world)."""
        return self.run is not None and self.world.main

    # ------------------------------------------------------------------ checkpoints
    def _restore_model(self, ckpt):
        meta, tensors = load_trainer_state(ckpt)
        load_model_state(self.model, ckpt)  # into the whole model, before any sharding
        return meta, tensors

    def _restore(self, meta: dict, tensors: dict) -> None:
        dist.load_optimizer(self.model, self.optimizer, optimizer_state(meta, tensors), self.tc.parallel)
        r = self.world.rank
        cpu = tensors.get(f"rng.torch.r{r}", tensors["rng.torch"] if r == 0 else None)
        if cpu is not None:
            torch.set_rng_state(cpu)
        else:  # resumed in a larger world: a fresh stream for this rank
            self._seed_rank(meta["step"])
        if self.device.type == "cuda":
            mine = tensors.get(f"rng.cuda.r{r}")
            if mine is not None:
                torch.cuda.set_rng_state(mine, self.device)
            elif self.world.size == 1 and "rng.cuda.0" in tensors:
                torch.cuda.set_rng_state_all([tensors[f"rng.cuda.{i}"]
                                              for i in range(torch.cuda.device_count()) if f"rng.cuda.{i}" in tensors])
        self.batches.set_state(data_state(tensors))
        self.step, self.elapsed = meta["step"], meta.get("elapsed", 0.0)
        self.tokens, self.skipped, self.saved = meta.get("tokens", 0), meta.get("skipped", 0), meta["step"]
        self.flops.restore(meta.get("flops"), self.tokens)

    def _seed_rank(self, step: int) -> None:
        """A rank's own RNG stream (ranks > 0, or a rank new to a resumed run)."""
        torch.manual_seed(self.tc.seed + 7919 * self.world.rank + step)

    def _rng(self) -> dict:
        """Every rank's RNG states (a collective in a world): rank 0's under the names
        one process uses, the others' as ``torch.r<rank>`` / ``cuda.r<rank>``."""
        if self.world.size == 1:
            return rng_states()
        mine = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            mine["cuda"] = torch.cuda.get_rng_state(self.device)
        out = {}
        for r, states in enumerate(dist.gather_objects(mine)):
            out["torch" if r == 0 else f"torch.r{r}"] = states["torch"]
            if "cuda" in states:
                out[f"cuda.r{r}"] = states["cuda"]
        return out

    def save(self) -> None:
        model_state, optim_state = dist.full_state(self.model, self.optimizer, self.tc.parallel)
        rng = self._rng()
        if self.world.main:
            self.trackers.flush()  # what the checkpoint covers is in the trackers' files first
            save_checkpoint(self.run.path, model_state, optim_state, self.step, self.batches.state(),
                            {"elapsed": self.elapsed + self.unlogged, "tokens": self.tokens, "skipped": self.skipped,
                             **({"flops": self.flops.total} if self.flops.total is not None else {}),
                             "world_size": self.world.size,
                             **self.compiler.state()},
                            rng=rng, config=self.run.config)
            self.keeper.saved(self.step)
        dist.barrier()
        self.saved = self.step

    def _diagnostics(self) -> dict:
        """The architecture's own quantities (``registry.diagnostics``): every process's
        statistics of the last micro-batch, the parameters whole (collectives in a world)."""
        if not registry.diagnostic_fns(self.model):  # nothing to compute: no gather, no unshard
            return {}
        with dist.unsharded(self.model):
            return registry.diagnostics(self.model, dist.gather_stats(self.stats))

    def _log(self, record: dict) -> None:
        self.records.append(record)
        if self.writes:
            self.run.log(record)
            self.trackers.log(record)
        if self.on_step is not None:
            self.on_step(record["step"], record)

    # ------------------------------------------------------------------ the loop
    def _snapshot(self):
        """What a step consumes (data position, random state, token count): the compile
        fallback re-runs a failed first compiled step from here."""
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None  # dropout's there
        return self.batches.state(), torch.get_rng_state(), self.tokens, self.flops.total, cuda

    def _rewind(self, snap) -> None:
        self.batches.set_state(snap[0])
        torch.set_rng_state(snap[1])
        if snap[4] is not None:
            torch.cuda.set_rng_state(snap[4], self.device)
        self.tokens, self.flops.total = snap[2], snap[3]
        self.optimizer.zero_grad(set_to_none=True)

    def _train_step(self, fwd) -> dict:
        tc, dev = self.tc, self.device
        lr = lr_at(self.step, tc)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        loss: torch.Tensor | float = 0.0
        aux: dict[str, torch.Tensor] = {}
        tokens = self.tokens
        drawn, weights = step_batches(self.batches, tc, self.world.size)  # weighting.py
        with sampled_depth(self.model, tc, self.step) as depth, tf32(dev.type == "cuda"):  # tc.depth_sample's
            for i, batch in enumerate(drawn):
                with dist.no_sync(fwd, sync=i == tc.grad_accum - 1), autocast(dev):
                    out = self.loss_fn(fwd, batch, dev)
                scaled, ce = step_loss(out, None if weights is None else weights[i], tc.grad_accum)
                with dist.no_sync(fwd, sync=i == tc.grad_accum - 1):
                    scaled.backward()
                loss = loss + ce  # no host sync until a log step
                for k, v in out.aux_losses.items():
                    aux[k] = aux.get(k, 0.0) + v.detach() / tc.grad_accum
                self.tokens += out.logits.shape[0] * out.logits.shape[1] * self.world.size
        self.stats = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.stats.items()}
        self.flops.add(self.tokens - tokens, depth)
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        if hasattr(gnorm, "full_tensor"):  # FSDP2: a DTensor of the global norm
            gnorm = gnorm.full_tensor()
        if self.world.size > 1:  # the mean over ranks: every rank decides alike below
            sums = dist.all_sum(loss, *aux.values())
            loss = (sums[0] / self.world.size).to(torch.float32)
            aux = {k: (v / self.world.size).to(torch.float32) for k, v in zip(aux, sums[1:])}
        if bool(torch.isfinite(loss.to(gnorm.device) + gnorm)):  # the one host sync a step
            self.optimizer.step()
        elif self.skipped < tc.skip_nonfinite:
            self.skipped += 1
        else:
            self.optimizer.zero_grad(set_to_none=True)
            ckpt = f"the checkpoint of step {self.saved} is intact" if self.saved is not None \
                else "no checkpoint was written"
            raise DivergedError(
                f"step {self.step + 1}: loss {float(loss):.4g}, gradient norm {float(gnorm):.4g}: "
                f"training diverged; the step was not applied and {ckpt}. Lower --lr (now "
                f"{tc.lr:g}) or lengthen --warmup, or resume with --skip-nonfinite K to skip "
                f"up to K such steps ({self.skipped} skipped so far)")
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"loss": loss, "lr": lr, "grad_norm": gnorm, **aux}

    def fit(self, stop_after: int | None = None) -> dict:
        """Run to ``tc.steps`` (or ``stop_after`` more steps, leaving the run unfinished:
        used to test interruption); returns the summary (also summary.json when done)."""
        self.setup()
        tc = self.tc
        bar = None
        if self.progress and self.world.main:
            bar = progress.bar(total=tc.steps, initial=self.step, desc=self.desc, unit="step")
        self.model.train()
        if self.writes and self.step < tc.steps:  # a finished run resumed: nothing to log
            self.trackers = Trackers.open(tc.log_to, self.run.path, self.step, self.run.config)
        self.flops.uncounted_s = 0.0  # setup's count (the trained depth) is before the clock starts
        t_last, tok_last, flops_last = time.perf_counter(), self.tokens, self.flops.total
        try:
            while self.step < tc.steps and (stop_after is None or self.ran < stop_after):
                rec = self.compiler.step(self._train_step, self._snapshot, self._rewind, tc.steps - self.step)
                t_last, self.flops.uncounted_s = t_last + self.flops.uncounted_s, 0.0  # counting: not training
                self.ran += 1
                last = self.step == tc.steps
                if self.step % tc.log_every == 0 or last:
                    dt = time.perf_counter() - t_last
                    self.elapsed += dt
                    tps = (self.tokens - tok_last) / max(dt, 1e-9)
                    done = self.flops.total
                    fpt = FlopCount.mean(None if flops_last is None or done is None else done - flops_last,
                                         self.tokens - tok_last)
                    util = dist.mfu(tps, fpt, self.peak, self.world.size)  # the steps' own depths
                    rec = {"step": self.step, **{k: float(v) for k, v in rec.items()},
                           "tokens": self.tokens, "tok_per_s": tps, **({"mfu": util} if util is not None else {}),
                           "elapsed_s": self.elapsed, **({"skipped_steps": self.skipped} if self.skipped else {})}
                    self._log(rec)
                    if bar is not None:
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tok_per_s']:.0f}")
                    t_last, tok_last, flops_last = time.perf_counter(), self.tokens, self.flops.total
                if bar is not None:
                    bar.update(1)
                t0 = time.perf_counter()  # evaluation and checkpoints are not training time
                # training time since the last logged step: an evaluation or checkpoint between logs counts it
                self.unlogged = 0.0 if self.step % tc.log_every == 0 or last else t0 - t_last
                best = False
                if self.evaluate is not None and (self.step % tc.eval_every == 0 or last):
                    self.last_eval = self.evaluate(self.model)
                    self._log({"step": self.step, **self.last_eval, **self._diagnostics(),
                               "elapsed_s": self.elapsed + self.unlogged})
                    if bar is not None and bar.disable:  # no terminal: one line an evaluation, not frames
                        dist.say(progress.eval_line(self.desc, self.step, tc.steps, self.records, self.last_eval))
                    best = self.keeper.evaluated(self.step, self.last_eval)  # checkpointed below
                if self.run is not None and (self.step % tc.ckpt_every == 0 or last or best):
                    self.save()  # every rank: gathering the state is a collective
                t_last += time.perf_counter() - t0
        except KeyboardInterrupt:
            if self.writes:
                remove_orphans(self.run.path)
            raise Interrupted(self.step, self.saved) from None
        except RuntimeError as e:  # gloo / NCCL: a peer process is gone
            if self.world.size == 1 or not dist.is_peer_failure(e):
                raise
            if self.writes:
                remove_orphans(self.run.path)
            ckpt = f"the checkpoint of step {self.saved} is intact" if self.saved is not None \
                else "no checkpoint was written"
            raise PeerFailed(f"another process of this {self.world.size}-process run failed at step "
                             f"{self.step + 1} ({str(e).splitlines()[0][-90:]}); {ckpt}: see that process's "
                             "error, then rerun the torchrun command with --resume") from None
        finally:
            if bar is not None:
                bar.close()
            self.trackers.close()
        return self.summary()

    def summary(self) -> dict:
        return {"run": str(self.run.path) if self.run is not None else None, "step": self.step,
                "finished": self.step >= self.tc.steps,
                "params": sum(p.numel() for p in self.model.parameters()),
                "elapsed_s": self.elapsed, "tok_per_s": self.tokens / max(self.elapsed, 1e-9),
                **({"mfu": u} if (u := dist.mfu(self.tokens / max(self.elapsed, 1e-9),
                                               FlopCount.mean(self.flops.total, self.tokens),
                                               self.peak, self.world.size)) is not None else {}),
                "peak_memory_mb": peak_memory_mb(self.device),
                **({"skipped_steps": self.skipped} if self.skipped else {}),
                **({"compile": self.compiler.chosen, "compile_note": self.compiler.line}
                   if getattr(self, "compiler", None) is not None and self.compiler.line else {}),
                **self.last_eval}
