"""`run.prepare` and `run.micro_batches`: the job's data-parallel plan applied to a user's own
model, with the code the built-in trainer runs (comm.py's compression hooks with error feedback,
autoratio.py's `ratio: auto`, sync.py's local and hierarchical SGD, optim.py's ZeRO-1).

    model, opt = run.prepare(model, lambda params: torch.optim.AdamW(params, lr=3e-4))
    for step in range(start + 1, run.steps + 1):
        for micro in run.micro_batches(loader):   # train.grad_accum parts; gradients sync on the last
            loss = loss_fn(model(micro[0]), micro[1]) / run.grad_accum
            loss.backward()
        opt.step(); opt.zero_grad()
        run.log(step, loss=..., samples=...)      # bytes_sent, comm_s, compute_s, optim_s filled in

What `prepare` does, from the JobSpec of the launch config (standalone: none of it):
- parallel.recompute full: each block (the largest ModuleList/Sequential of modules of one class,
  or `blocks="name"`) runs its forward under torch.utils.checkpoint (use_reentrant=False); its
  parameters keep their names, so checkpoints load under either setting.
- DDP over every rank with the comm hook of `comm` (compression, sync), counting the bytes each
  rank hands to gradient collectives; or, with parallel.fsdp, FSDP2 (`fully_shard`) on each block
  and then the root over a 1-D mesh of the ranks: each rank holds 1/world of every parameter,
  gradient and optimizer state (its collectives are not metered: compute_s holds them). Parameter
  names stay the plain model's, so a DDP checkpoint resumes under FSDP and back (DCP reshards).
- parallel.tp > 1 (tp, or dp x tp): tensorpar.py's Megatron-style plan by module-name patterns
  (or the script's `tp_plan`), applied in place with DTensor; embeddings, norms and the head stay
  replicated; under dp x tp the gradients are averaged over dp before the optimizer's step.
- the optimizer from the user's factory; with parallel.shard_optimizer, ZeRO-1 of the same class
  and defaults over the data-parallel ranks (one parameter group); with comm.sync local_sgd or
  hierarchical, torch's PostLocalSGDOptimizer around it.

The step's telemetry is measured as the trainer's (trainer.py's docstring defines the fields):
the first forward after an optimizer step opens the step (the sync's `begin_step`), the
optimizer's step ends it, and `run.log` closes it with the step's bytes and phase times. A
metric the script passes to `run.log` itself wins. After the first step each rank reports its
`rank_plan` event (strategy, mesh, role, bytes of parameters and optimizer state held).

train.balance auto (plain DDP): the ranks take shares of each global batch proportional to
their measured compute speed (trainyard/sdk/balance.py, the trainer's code): `run.loader` hands
each rank its current share, and each parameter's gradient is scaled by world x n_i / N before
DDP averages it, so the update is the whole global batch's mean whatever the split (each rank
still reports its own mean loss, and its `share`). The speeds are exchanged in `run.log` (a gloo
all-gather): every rank logs every step, as telemetry already asks.

A job whose JobSpec asks for what only `prepare` applies (compression, model averaging,
grad_accum > 1, recompute, shard_optimizer, fsdp, tp, balance) and whose script calls `run.log` without having
called `prepare` fails at that first `run.log` with a ConfigError (a user error: no restart).
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from trainyard.mesh import Mesh

from .comm import CommCounter, CpuClock, CudaClock, GradCompression, RunComm
from .config import ConfigError
from .metainit import materialise, on_meta, save_buffers, uninitialisable
from .optim import ZeroOptimizer, state_optimizer
from .sync import build_sync

if TYPE_CHECKING:
    from trainyard.spec import JobSpec


def needs_prepare(spec: JobSpec | None) -> list[str]:
    """What of `spec` only run.prepare applies (empty: a script without prepare runs as asked)."""
    if spec is None:
        return []
    c, p = spec.comm, spec.plan
    out = []
    if c.compression != "none":
        out.append(f"comm.compression {c.compression}")
    if c.sync != "allreduce":
        out.append(f"comm.sync {c.sync}")
    if spec.train.grad_accum > 1:
        out.append(f"train.grad_accum {spec.train.grad_accum}")
    if p.recompute != "none":
        out.append(f"parallel.recompute {p.recompute}")
    if p.shard_optimizer:
        out.append("parallel.shard_optimizer")
    if p.fsdp:
        out.append("parallel.fsdp")
    if p.tp > 1:
        out.append(f"parallel.tp {p.tp}")
    if spec.parallel == "auto":
        out.append("parallel auto")
    if spec.train.balance != "none":
        out.append(f"train.balance {spec.train.balance}")
    return out


def find_blocks(model: nn.Module, name: str | None = None) -> tuple[str, list[nn.Module]]:
    """The model's repeated blocks: the ModuleList/Sequential named `name`, or else the largest
    one whose children are all of one class (how transformer models are built). ("", []) when
    it has none."""
    if name is not None:
        try:
            found = model.get_submodule(name)
        except AttributeError:
            raise ConfigError(f"run.prepare: the model has no submodule {name!r} (blocks=...)") from None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) == 0:
            raise ConfigError(f"run.prepare: blocks={name!r} is a {type(found).__name__}, not a non-empty "
                              f"ModuleList or Sequential of the model's blocks")
        return name, list(found)
    best: tuple[str, list[nn.Module]] = ("", [])
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > len(best[1]):
            kids = list(module)
            if len({type(k) for k in kids}) == 1:
                best = (path, kids)
    return best


HEAD_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "heads")


def describe(model: nn.Module, blocks_name: str, blocks: list[nn.Module]) -> dict | None:
    """The model as the knowledge base records it: its blocks (count, parameters each), hidden size
    and vocabulary (its largest embedding), attention heads where a block names them; the sequence
    length is added at the first forward. None for a model without repeated blocks."""
    if not blocks:
        return None
    params = sum(p.numel() for p in model.parameters())
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = max(embeddings, key=lambda e: e.num_embeddings, default=None)
    linears = [m for m in blocks[0].modules() if isinstance(m, nn.Linear)]
    hidden = vocab.embedding_dim if vocab is not None else linears[0].in_features if linears else None
    heads = None
    for m in blocks[0].modules():
        if isinstance(m, nn.MultiheadAttention):
            heads = m.num_heads
        value = next((getattr(m, a) for a in HEAD_ATTRS if isinstance(getattr(m, a, None), int)), None)
        heads = heads or value
    if not hidden:
        return None
    return {"kind": "user", "layers": len(blocks), "hidden": int(hidden), "heads": heads,
            "vocab": vocab.num_embeddings if vocab is not None else None, "params": int(params),
            "params_per_block": int(sum(p.numel() for p in blocks[0].parameters())), "blocks": blocks_name[:200]}


def _recompute(block: nn.Module) -> None:
    """Run `block`'s forward under activation checkpointing (in training, with gradients)."""
    forward = block.forward

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if block.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    block.forward = recomputed  # an instance attribute: parameter names stay as they were
    block.recompute = True


def _zero(opt: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if len(opt.param_groups) != 1:
        raise ConfigError(f"run.prepare: parallel.shard_optimizer (ZeRO-1) builds {type(opt).__name__} over "
                          f"one parameter group, but the optimizer factory made {len(opt.param_groups)}: "
                          f"give every parameter the same settings, or use shard_optimizer false")
    # the factory's settings, as far as the class's constructor takes them (AdamW's defaults also
    # hold decoupled_weight_decay, which only Adam's takes)
    accepted = inspect.signature(type(opt).__init__).parameters
    return ZeroOptimizer(params, type(opt), **{k: v for k, v in opt.defaults.items() if k in accepted})


def split(batch: Any, parts: int) -> list[Any]:
    """`batch` (a tensor, or a tuple/list/dict of them, batch dimension first) as `parts` equal
    micro-batches; other values are repeated as they are."""
    if parts == 1:
        return [batch]
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % parts:
            raise ValueError(f"run.micro_batches: a batch of {batch.shape[0]} samples does not split into "
                             f"train.grad_accum = {parts} equal micro-batches")
        return list(batch.chunk(parts))
    if isinstance(batch, (tuple, list)):
        cols = [split(b, parts) for b in batch]
        return [type(batch)(c[i] for c in cols) for i in range(parts)]
    if isinstance(batch, dict):
        cols = {k: split(v, parts) for k, v in batch.items()}
        return [{k: v[i] for k, v in cols.items()} for i in range(parts)]
    return [batch] * parts


class Prepared:
    """What `run.prepare` built for one rank: the DDP module, the optimizer, the sync, and the
    step's measurements."""

    def __init__(self, run: Any, model: nn.Module, make_optimizer: Callable[[list], torch.optim.Optimizer],
                 *, blocks: str | None = None, tp_plan: dict | None = None, seq_len: int | None = None):
        self.run = run
        self.blocks_name, blocks_found = find_blocks(model, blocks)
        self.description = describe(model, self.blocks_name, blocks_found)  # before sharding
        self.auto: dict | None = None  # parallel auto: the planner's choice (autoplan.py)
        if run.spec is not None and run.spec.parallel == "auto":
            self._plan_auto(model, blocks_found, tp_plan, seq_len)
        spec: JobSpec | None = run.spec
        self.accum = spec.train.grad_accum if spec else 1
        world = dist.get_world_size()
        p = spec.plan if spec else None
        self.fsdp = bool(p and p.fsdp)
        self.mesh = Mesh.for_world(world, fsdp=self.fsdp, tp=p.tp if p else 1)
        self.tensor: Any = None  # tensorpar.TensorParallel under tp
        self.recompute = bool(p and p.recompute == "full")
        for wanted, setting in ((self.recompute, "parallel.recompute full checkpoints"),
                                (self.fsdp, "parallel.fsdp shards")):
            if wanted and not blocks_found:
                raise ConfigError(f"run.prepare: {setting} the model's blocks, but it has no ModuleList/Sequential "
                                  f"of modules of one class: name them with prepare(..., blocks='layers')")
        if self.recompute:
            for b in blocks_found:
                _recompute(b)
        self.meta_init = self._meta_buffers(model)  # built under run.init_device: parameters on meta
        self.inner = model if self.meta_init is not None else model.to(run.device)
        self.clock = CudaClock(run.device) if run.device.type == "cuda" else CpuClock()
        self.counter = CommCounter(self.clock)
        c = spec.comm if spec else None
        self.compression = GradCompression(c.compression if c else "none", self.counter,
                                           ratio=c.ratio if c else 0.01, rank=c.rank if c else 2,
                                           start_step=c.start_step if c else 0, seed=run.seed)
        self.run_comm = RunComm(self.compression.kind)
        self.sync = build_sync(c.sync if c else "allreduce", rank=run.rank, world=world, counter=self.counter,
                               compression=self.compression, auto_ratio=bool(c and c.ratio == "auto"),
                               start_step=c.start_step if c else 0, period=c.period if c else 1,
                               periods=(c.periods.node, c.periods.global_) if c else (1, 2),
                               procs_per_node=spec.resources.procs_per_node if spec else 1,
                               event=run.event, say=_say if run.rank == 0 else (lambda line: None))
        self.module = self._wrap(run, world, blocks_found, tp_plan)
        if self.meta_init is not None:  # this rank's shards only, allocated and initialised
            self.meta_init = materialise(self.inner, run.device, self.meta_init)
        params = list(self.module.parameters())
        opt = make_optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"run.prepare: the optimizer factory returned a {type(opt).__name__}, not a "
                              f"torch.optim.Optimizer")
        self.shard = bool(p and p.shard_optimizer)
        if self.shard:
            opt = _zero(opt, params)
        self.opt = self.sync.wrap(opt)
        self.state_opt = state_optimizer(self.opt)
        self._wrap_step(self.opt)
        self.module.register_forward_pre_hook(self._forward_starts)
        self.balance = self._start_balance(spec, world) if spec and spec.train.balance == "auto" else None
        self._open = False
        self._ref = self._backward_end = self._optim_start = self._optim_end = None
        self._reported = False

    def _start_balance(self, spec: JobSpec, world: int) -> Any:
        """train.balance auto: the trainer's Balance (a gloo group: every rank calls prepare), its
        slices handed to the run's loaders, and each gradient weighted by this rank's share."""
        from .balance import Balance

        say = _say if self.run.rank == 0 else (lambda line: None)
        balance = Balance.start(world, self.run.rank, spec.train.global_batch, self.accum,
                                _Slices(self.run, spec.train.global_batch), self.run, say)
        for p in self.inner.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g if balance.weight == 1.0 else g * balance.weight)
        return balance

    def _meta_buffers(self, model: nn.Module) -> dict | None:
        """The buffers to restore after materialising, when the model's parameters are on meta."""
        if not on_meta(model):
            return None
        if not (self.fsdp or self.mesh.tp > 1):
            raise ConfigError("run.prepare: the model's parameters are on the meta device, but this plan keeps the "
                              "whole model on every rank: build it on run.device (run.init_device() does so "
                              "unless the plan is fsdp or tp)")
        missing = uninitialisable(model)
        if missing:
            raise ConfigError(f"run.prepare: the model was built on the meta device (run.init_device), but nothing "
                              f"would initialise the parameters of {', '.join(missing[:5])}: give those modules a "
                              f"reset_parameters() or the model an init_weights(), or build it outside init_device")
        return save_buffers(model)

    def _plan_auto(self, model: nn.Module, blocks: list[nn.Module], tp_plan: dict | None, seq_len: Any) -> None:
        """parallel auto: plan the described model (autoplan.py) and make the plan the run's spec."""
        from trainyard.plan.choice import label

        from .autoplan import plan_user_model
        from .tensorpar import plan_styles

        run = self.run
        if self.description is None:
            raise ConfigError("run.prepare: parallel auto plans your model from its blocks, but it has no "
                              "ModuleList/Sequential of modules of one class: name them with blocks='layers', "
                              "or give the job a parallel section")
        seq_len = seq_len if seq_len is not None else run.config.get("seq_len")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= 10_000_000:
            raise ConfigError(f"run.prepare: parallel auto plans your model from its shape, which needs the tokens "
                              f"per sample: pass run.prepare(..., seq_len=N) (got {seq_len!r})")
        if run._loaders:
            raise ConfigError("run.prepare: under parallel auto call run.loader after run.prepare (the plan "
                              "chosen decides each rank's share of the batch)")
        self.description["seq_len"] = seq_len
        names = {id(m): n for n, m in model.named_modules()}
        block_names = [names[id(b)] for b in blocks]

        def tp_ok(tp: int) -> bool:
            try:
                plan_styles(model, tp, block_names, tp_plan)
            except ConfigError:
                return False
            return True

        resolved, self.auto = plan_user_model(run.spec, self.description,
                                              run.launch.planner if run.launch else None, tp_ok)
        run.spec, run.grad_accum = resolved, resolved.train.grad_accum
        chosen = self.auto["chosen"]
        if run.rank == 0:
            _say(f"parallel auto: {label(chosen)}, grad_accum {resolved.train.grad_accum}, predicted "
                 f"{chosen['step_time_s']:.4g} s a step, best of {self.auto['candidates']} plans "
                 f"({self.auto['constants_source']})")

    def _wrap(self, run: Any, world: int, blocks: list[nn.Module], tp_plan: dict | None) -> nn.Module:
        """The module the script trains: FSDP2 (each block a unit, then the root: what is left,
        embeddings and head), the tp plan applied in place, or DDP with the comm hook."""
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            device_mesh = init_device_mesh(run.device.type, (world,), mesh_dim_names=("dp",))
            for b in blocks:
                fully_shard(b, mesh=device_mesh)
            return fully_shard(self.inner, mesh=device_mesh)
        if self.mesh.tp > 1:
            from .tensorpar import TensorParallel

            names = {id(m): n for n, m in self.inner.named_modules()}
            self.tensor = TensorParallel(self.inner, self.mesh, run.device, blocks=[names[id(b)] for b in blocks],
                                         user_plan=tp_plan)
            return self.tensor.module
        if tp_plan is not None:
            raise ConfigError("run.prepare: tp_plan applies under parallel.tp > 1; this job has tp 1")
        module = DDP(self.inner, device_ids=[run.device.index] if run.device.type == "cuda" else None,
                     gradient_as_bucket_view=True)
        if self.sync.hook is not None:
            module.register_comm_hook(self.sync.hook_state, self.sync.hook)
        return module

    # ---- the step's boundaries ------------------------------------------------------------
    def _forward_starts(self, module: nn.Module, args: Any) -> None:
        if self._open:
            return
        self._open = True
        self._ref = self.clock.mark()
        if self.description is not None and "seq_len" not in self.description:
            first = args[0] if args else None
            tokens = isinstance(first, torch.Tensor) and (  # (batch, sequence) ids or (batch, sequence, hidden)
                (first.dim() == 2 and not first.is_floating_point()) or (first.dim() == 3 and first.is_floating_point()))
            if tokens and 0 < first.shape[1] <= 10_000_000:
                self.description["seq_len"] = int(first.shape[1])  # not for images: no sequence there
                if self.run.spec is None and self.run.rank == 0:  # standalone: what `trainyard plan` takes
                    self._say_plan_request(int(first.shape[0]) * dist.get_world_size())
        self._backward_end = self._optim_start = self._optim_end = None
        self.sync.begin_step(self.run.next_step())  # compression's step, local SGD's counters

    def _say_plan_request(self, global_batch: int) -> None:
        """Standalone: print the planner request for this model (autoplan.standalone_request), so
        its plan on a cluster can be seen before submitting (`trainyard plan FILE`)."""
        import json

        from .autoplan import standalone_request

        req = standalone_request(self.description, world=dist.get_world_size(), device=self.run.device.type,
                                 global_batch=global_batch)
        _say("run.prepare: the plan of this model on a cluster, before submitting: save the next line, set its "
             "cluster, then `trainyard plan FILE`")
        _say("trainyard plan request: " + json.dumps(req, sort_keys=True))

    def _wrap_step(self, opt: torch.optim.Optimizer) -> None:
        step = opt.step

        def measured_step(*args: Any, **kwargs: Any) -> Any:
            if self.tensor is not None:  # dp x tp: the gradients averaged over dp first
                self.tensor.average_over_dp(self.counter)
            self._backward_end = self.clock.mark()
            self.run.wait_for_staging()  # an async save's copy first (checkpoint blocking, not optim_s)
            self._optim_start = self.clock.mark()
            out = step(*args, **kwargs)
            self._optim_end = self.clock.mark()
            return out

        opt.step = measured_step  # an instance attribute: the optimizer's class stays as it is

    def micro_batches(self, source: Any) -> Iterator[Any]:
        """The next step's batch (`next(source)` for a loader or iterator, else `source` itself) as
        train.grad_accum micro-batches; the backward passes of all but the last run under DDP's
        no_sync, so gradients are averaged once, on the last."""
        batch = next(source) if isinstance(source, Iterator) else source
        parts = split(batch, self.accum)
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if self.fsdp:  # FSDP's no_sync: unsharded gradients accumulate until the last
                self.module.set_requires_gradient_sync(last)
            if self.fsdp or self.tensor is not None:  # tp averages over dp at the optimizer's step
                yield part
                continue
            with contextlib.nullcontext() if last else self.module.no_sync():
                yield part

    def end_step(self, step: int) -> dict:
        """The step's sample fields (bytes and phase times; the sync's own fields); {} when no
        forward ran since the last one."""
        if not self._open:
            return {}
        self._open = False
        clock = self.clock
        clock.sync()
        comm = self.counter.take()
        self.run_comm.add(comm, self.compression.compressing)
        backward_end = self._backward_end or clock.mark()
        comm_s, exposed_s = comm.measure(clock, self._ref, backward_end)
        compute_s = max(0.0, clock.seconds(self._ref, backward_end) - exposed_s)
        avg_s, sync_fields = self.sync.end_step(step, comm, comm_s, compute_s)
        out: dict[str, Any] = {"bytes_sent": comm.bytes_sent, "comm_s": comm_s + avg_s, "compute_s": compute_s}
        if self.fsdp:  # FSDP's all-gathers and reduce-scatters are not metered: compute_s holds them
            out = {"compute_s": clock.seconds(self._ref, backward_end)}
        # under tp the dp average is metered (bytes_sent, comm_s); tp's own collectives are in compute_s
        if self._optim_start is not None and self._optim_end is not None:
            out["optim_s"] = max(0.0, clock.seconds(self._optim_start, self._optim_end) - avg_s)
        out.update(sync_fields)
        if self.balance is not None:
            if not self._reported and not any(loader.balanced for loader in self.run._loaders):  # once
                raise ConfigError("train.balance auto resizes each rank's share of the batch through run.loader, "
                                  "but this script's data does not come from run.loader: use run.loader(dataset), "
                                  "or train.balance none")
            out["share"] = self.balance.share  # this step's; a new split applies from the next
            self.balance.after_step(step, out["compute_s"])
        if not self._reported:
            self._reported = True
            self.report_plan()
        return out

    def report_plan(self) -> None:
        from .optim import optim_bytes, param_bytes

        rank, dp = self.run.rank, self.mesh.dp
        strategy = "fsdp" if self.fsdp else "ddp" if self.tensor is None else "tp" if dp == 1 else "dp x tp"
        if self.fsdp:
            role = (f"shard {self.mesh.coords(rank)['dp']} of {dp}: 1/{dp} of every parameter, gradient and "
                    f"optimizer state (FSDP2 per block of {self.blocks_name}, then the root)")
        elif self.tensor is not None:
            role = self.tensor.role(rank, (self.description or {}).get("heads"))
        else:
            role = f"replica {self.mesh.coords(rank)['dp']} of {dp}: the whole model"
        if self.shard:
            role += f"; optimizer state: its 1/{dp} share (ZeRO-1)"
        if self.recompute:
            role += f"; activations recomputed in backward ({self.blocks_name})"
        if isinstance(self.meta_init, str):
            role += f"; built on the meta device, this shard initialised by {self.meta_init}"
        opt_bytes = optim_bytes(self.state_opt)
        self.run.event("rank_plan", rank=rank, node=self.run.node, strategy=strategy, mesh=self.mesh.describe(),
                       coords=self.mesh.coords(rank), role=role, param_bytes=param_bytes(self.inner),
                       optim_bytes=opt_bytes, recompute="full" if self.recompute else "none",
                       shard_optimizer=self.shard,
                       **({"model": self.description} if self.description and rank == 0 else {}),
                       **({"auto": self.auto} if self.auto and rank == 0 else {}))
        _say(f"rank {rank} plan {strategy} mesh {self.mesh.shape} comm {self.compression.kind} sync {self.sync.name} "
             f"grad_accum {self.accum} param_bytes {param_bytes(self.inner)} optim_bytes {opt_bytes}")


class _Slices:
    """Balance's data side for run.loader: the current split, applied to every loader of the run
    (those made before prepare and after)."""

    def __init__(self, run: Any, total: int):
        self.run, self.total = run, total

    def set_slice(self, offset: int, n: int) -> None:
        for loader in self.run._loaders:
            if loader.global_batch != self.total:
                raise ConfigError(f"run.loader: under train.balance auto a loader's batch is the rank's share of "
                                  f"train.global_batch ({self.total}), but this one's global batch is "
                                  f"{loader.global_batch}: leave batch_size out")
            loader.set_slice(offset, n)


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
