"""The runtime's view of its launch config: `<run_dir>/config.json` parsed into frozen dataclasses.

The control plane has already validated the JobSpec (trainyard/spec.py) and filled every default,
but the runtime must not import it (it runs under torchrun, without Django), so it parses the
subset it honours here. Keys it does not use (priority, max_restarts, ...) are ignored; values
it cannot honour in this milestone (tensor/pipeline parallel, FSDP, local SGD, balancing) are
refused with a clear error instead of being silently trained the wrong way.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BYTE_VOCAB = 256  # the demo corpus is byte-level: every id in [0, 256)


class ConfigError(ValueError):
    """The launch config asks for something the runtime cannot run; the message says what."""


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "gpt"  # gpt | mlp
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq_len: int = 128
    vocab: int = 256


@dataclass(frozen=True)
class DataConfig:
    kind: str = "demo"  # demo | synthetic | tokens
    path: str | None = None  # tokens only, relative to data_root


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 32
    lr: float = 1.0e-3
    warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    seed: int = 0
    grad_accum: int = 1
    balance: str = "none"


@dataclass(frozen=True)
class ResourcesConfig:
    nodes: int = 2
    procs_per_node: int = 1
    device: str = "cpu"  # cpu | cuda

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass(frozen=True)
class ParallelConfig:
    dp: int | None = None  # None when the spec said "auto": plain DDP over the whole world
    tp: int = 1
    pp: int = 1
    fsdp: bool = False
    microbatches: int = 4  # pp: micro-batches per step (of global_batch / dp samples)
    schedule: str = "1f1b"  # pp: 1f1b | gpipe


COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "topk")


@dataclass(frozen=True)
class CommConfig:
    compression: str = "none"  # none | fp16 | bf16 | powersgd | topk (see comm.py)
    ratio: float | str = 0.01  # topk: fraction of each bucket sent, (0, 1]; "auto" is refused
    rank: int = 2  # powersgd: matrix approximation rank
    start_step: int = 10  # steps 1..start_step all-reduce dense gradients, compression after
    sync: str = "allreduce"  # allreduce | local_sgd | hierarchical
    period: int = 4  # local_sgd: average the models every `period` steps (after start_step)
    periods: dict = None  # hierarchical: {"node": n, "global": g} averaging periods

    def __post_init__(self) -> None:
        if self.periods is None:
            object.__setattr__(self, "periods", {"node": 2, "global": 8})


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 50
    async_: bool = True  # spec key "async" (a Python keyword)
    keep: int = 3  # retention is the control plane's call (it knows which are superseded)


@dataclass(frozen=True)
class ResumeConfig:
    """Top-level launch key `resume`: the complete checkpoint this attempt starts from."""

    path: Path
    step: int
    checkpoint_id: int | None = None


@dataclass(frozen=True)
class RunConfig:
    job_id: int
    attempt_id: int
    node: str
    run_dir: Path
    redis_url: str
    stream: str
    data_root: Path
    checkpoint_dir: Path
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    resources: ResourcesConfig
    parallel: ParallelConfig
    comm: CommConfig
    checkpoint: CheckpointConfig = CheckpointConfig()
    resume: ResumeConfig | None = None

    def per_rank_batch(self, world_size: int) -> int:
        """Samples one rank consumes per optimizer step (all its micro-batches together)."""
        if self.train.global_batch % world_size:
            raise ConfigError(
                f"train.global_batch={self.train.global_batch} is not divisible by the "
                f"world size {world_size}")
        return self.train.global_batch // world_size

    def micro_batch(self, world_size: int) -> int:
        """Samples per forward/backward: global_batch / (world size x train.grad_accum)."""
        per_rank, k = self.per_rank_batch(world_size), self.train.grad_accum
        if per_rank % k:
            raise ConfigError(
                f"train.global_batch={self.train.global_batch} is not divisible by world size x "
                f"train.grad_accum = {world_size} x {k}")
        return per_rank // k


def _section(spec: dict[str, Any], key: str, cls: type, path: str = "spec") -> Any:
    """Build dataclass `cls` from spec[key], keeping only the fields it declares."""
    raw = spec.get(key) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}.{key} must be an object, got {raw!r}")
    names = cls.__dataclass_fields__.keys()
    return cls(**{k: v for k, v in raw.items() if k in names})


def _parallel(spec: dict[str, Any]) -> ParallelConfig:
    raw = spec.get("parallel", "auto")
    if raw == "auto":
        return ParallelConfig()
    return _section(spec, "parallel", ParallelConfig)


def _checkpoint(spec: dict[str, Any]) -> CheckpointConfig:
    raw = dict(spec.get("checkpoint") or {})
    if "async" in raw:
        raw["async_"] = raw.pop("async")
    return _section({"checkpoint": raw}, "checkpoint", CheckpointConfig)


def _resume(raw: Any) -> ResumeConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or "path" not in raw or "step" not in raw:
        raise ConfigError(f"resume must be null or an object with path and step, got {raw!r}")
    try:
        return ResumeConfig(path=Path(raw["path"]), step=int(raw["step"]),
                            checkpoint_id=raw.get("checkpoint_id"))
    except (TypeError, ValueError):
        raise ConfigError(f"resume.path must be a string and resume.step an integer, got {raw!r}") from None


def _check(cfg: RunConfig) -> None:
    m, d, t, p, c = cfg.model, cfg.data, cfg.train, cfg.parallel, cfg.comm
    if m.kind not in ("gpt", "mlp"):
        raise ConfigError(f"model.kind must be gpt or mlp, got {m.kind!r}")
    for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if int(getattr(m, name)) < 1:
            raise ConfigError(f"model.{name} must be >= 1, got {getattr(m, name)}")
    if m.kind == "gpt" and m.hidden % m.heads:
        raise ConfigError(f"model.hidden={m.hidden} must be divisible by model.heads={m.heads}")
    if d.kind not in ("demo", "synthetic", "tokens"):
        raise ConfigError(f"data.kind must be demo, synthetic or tokens, got {d.kind!r}")
    if d.kind == "demo" and m.vocab < BYTE_VOCAB:
        raise ConfigError(
            f"data.kind=demo is byte-level text and needs model.vocab >= {BYTE_VOCAB}, "
            f"got model.vocab={m.vocab}")
    if d.kind == "tokens" and not d.path:
        raise ConfigError("data.kind=tokens needs data.path (a uint16 .bin under the data root)")
    if d.kind == "tokens" and m.vocab > 65536:
        raise ConfigError(f"data.kind=tokens stores uint16 ids, so model.vocab <= 65536, got {m.vocab}")
    if t.steps < 1 or t.global_batch < 1 or not (t.lr > 0 and math.isfinite(t.lr)):
        raise ConfigError(f"train needs steps >= 1, global_batch >= 1, lr > 0; got {t}")
    if t.lr_schedule not in ("constant", "cosine"):
        raise ConfigError(f"train.lr_schedule must be constant or cosine, got {t.lr_schedule!r}")
    if isinstance(t.grad_accum, bool) or not isinstance(t.grad_accum, int) or t.grad_accum < 1:
        raise ConfigError(f"train.grad_accum must be an integer >= 1, got {t.grad_accum!r}")
    world = cfg.resources.world_size
    dp = p.dp if p.dp is not None else max(1, world // max(1, p.tp * p.pp))
    if t.global_batch % (dp * t.grad_accum):
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by the data-parallel size x "
            f"train.grad_accum = {dp} x {t.grad_accum}")
    if t.balance not in ("none", "auto"):
        raise ConfigError(f"train.balance must be none or auto, got {t.balance!r}")
    if cfg.resources.device not in ("cpu", "cuda"):
        raise ConfigError(f"resources.device must be cpu or cuda, got {cfg.resources.device!r}")
    for name in ("tp", "pp", "microbatches"):
        v = getattr(p, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"parallel.{name} must be an integer >= 1, got {v!r}")
    if p.schedule not in ("1f1b", "gpipe"):
        raise ConfigError(f"parallel.schedule must be 1f1b or gpipe, got {p.schedule!r}")
    if m.kind == "gpt" and m.heads % p.tp:
        raise ConfigError(f"parallel.tp={p.tp} must divide model.heads={m.heads}")
    if p.pp > m.layers:
        raise ConfigError(f"parallel.pp={p.pp} is more stages than model.layers={m.layers}")
    if c.compression not in COMPRESSIONS:
        raise ConfigError(f"comm.compression must be one of {', '.join(COMPRESSIONS)}, got {c.compression!r}")
    if c.compression == "topk" and not (_is_fraction(c.ratio) or c.ratio == "auto"):
        raise ConfigError(f"comm.ratio must be a number in (0, 1] or 'auto' for compression topk, "
                          f"got {c.ratio!r}")
    if isinstance(c.rank, bool) or not isinstance(c.rank, int) or c.rank < 1:
        raise ConfigError(f"comm.rank must be an integer >= 1, got {c.rank!r}")
    if isinstance(c.start_step, bool) or not isinstance(c.start_step, int) or c.start_step < 0:
        raise ConfigError(f"comm.start_step must be an integer >= 0, got {c.start_step!r}")
    if c.sync not in ("allreduce", "local_sgd", "hierarchical"):
        raise ConfigError(f"comm.sync must be allreduce, local_sgd or hierarchical, got {c.sync!r}")
    if isinstance(c.period, bool) or not isinstance(c.period, int) or c.period < 1:
        raise ConfigError(f"comm.period must be an integer >= 1, got {c.period!r}")
    if int(cfg.checkpoint.every_steps) < 1:
        raise ConfigError(f"checkpoint.every_steps must be >= 1, got {cfg.checkpoint.every_steps}")
    if cfg.resume is not None and not cfg.resume.path.is_absolute():
        raise ConfigError(f"resume.path must be absolute, got {str(cfg.resume.path)!r}")
    if cfg.resume is not None and cfg.resume.step < 0:
        raise ConfigError(f"resume.step must be >= 0, got {cfg.resume.step}")


def _is_fraction(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1


def parse_run_config(raw: dict[str, Any]) -> RunConfig:
    """Parse the launch config dict; raises ConfigError naming the offending field."""
    try:
        spec = raw["spec"]
        cfg = RunConfig(
            job_id=int(raw["job_id"]),
            attempt_id=int(raw["attempt_id"]),
            node=str(raw["node"]),
            run_dir=Path(raw["run_dir"]),
            redis_url=str(raw["redis_url"]),
            stream=str(raw["stream"]),
            data_root=Path(raw["data_root"]),
            checkpoint_dir=Path(raw["checkpoint_dir"]),
            model=_section(spec, "model", ModelConfig),
            data=_section(spec, "data", DataConfig),
            train=_section(spec, "train", TrainConfig),
            resources=_section(spec, "resources", ResourcesConfig),
            parallel=_parallel(spec),
            comm=_section(spec, "comm", CommConfig),
            checkpoint=_checkpoint(spec),
            resume=_resume(raw.get("resume")),
        )
    except KeyError as e:
        raise ConfigError(f"launch config is missing key {e.args[0]!r}") from None
    except TypeError as e:  # a section held a value of the wrong shape
        raise ConfigError(f"launch config is malformed: {e}") from None
    _check(cfg)
    return cfg


def load_run_config(path: str | Path) -> RunConfig:
    with open(path, encoding="utf-8") as f:
        return parse_run_config(json.load(f))
