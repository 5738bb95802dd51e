"""The schema of a job stream's entries, and the relay's dead letters (no database here).

Writers (trainyard/sdk/reporter.py, workers/agent.py) XADD to their attempt's own stream
`trainyard:job:<job>:a<attempt>` (trainyard.keys.attempt_stream), which only that attempt's Redis
user may write (trainyard.redis_acl), so the stream is the proof of who wrote an entry:
    {type: metrics, data: <JSON list of samples, at most MAX_SAMPLES>}
    {type: event,   data: <JSON {"kind": ..., "attempt": a, "rank": r, ...}>}
    {type: log,     data: <JSON {"attempt": a, "rank": r, "stream": "stdout", "lines": [...]}>}
`parse_entry` accepts exactly these (pydantic, strict: a bool is not an int, a string not a
number) or raises EntryError with the reason; the relay moves a refused entry to the dead-letter
stream (keys.DEADLETTER_STREAM, capped at DEADLETTER_MAXLEN entries of at most DEADLETTER_DATA_MAX
bytes of the original data), acknowledges it on its own stream and counts it. An entry may name
only its stream's attempt (`entry_attempts`), and that attempt must be its stream's job's (the
relay checks that against the database).

Validation costs ~1.6 us a sample on the 2-core dev VM (a TypedDict, validated only: the relay
keeps orjson's dicts); the relay's ingest costs ~3 us a sample on top.
"""
from __future__ import annotations

import re
import time
from itertools import chain, repeat
from operator import itemgetter
from typing import Annotated, Any, Literal, Optional

import orjson
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import NotRequired, TypedDict

from trainyard import keys

MAX_ENTRY_BYTES = 4 * 1024 * 1024  # a reporter's entry is < 256 KB (500 samples)
MAX_SAMPLES = 5000
MAX_LOG_LINES = 10_000
DEADLETTER_MAXLEN = 1000
DEADLETTER_DATA_MAX = 2048
REASON_MAX = 500

_STREAM = re.compile(re.escape(keys.JOB_STREAM_PREFIX) + r"([1-9][0-9]{0,17}):a([1-9][0-9]{0,17})")

Id = Annotated[int, Field(ge=1, lt=2**63)]
Count = Annotated[int, Field(ge=0, lt=2**63)]
Rank = Annotated[int, Field(ge=0, lt=2**31)]
Num = Optional[float]  # strict float: int or float, never bool or str
_STRICT = ConfigDict(extra="allow", strict=True)


class Sample(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    attempt: Id
    rank: Rank
    step: Count
    ts: float
    loss: NotRequired[Num]
    samples_per_s: NotRequired[Num]
    tokens_per_s: NotRequired[Num]
    step_s: NotRequired[Num]
    data_s: NotRequired[Num]
    compute_s: NotRequired[Num]
    comm_s: NotRequired[Num]
    optim_s: NotRequired[Num]
    bytes_sent: NotRequired[Num]
    mem_bytes: NotRequired[Num]
    compression_ratio: NotRequired[Num]
    share: NotRequired[Num]
    metrics: NotRequired[Optional[dict[str, Any]]]


class Event(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    kind: Annotated[str, Field(min_length=1, max_length=64)]
    attempt: Id
    rank: NotRequired[Optional[Rank]]


class CheckpointEvent(Event):
    step: Count
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    size_bytes: NotRequired[Num]
    blocking_s: NotRequired[Num]
    save_s: NotRequired[Num]


class ResumedEvent(Event):
    step: Count
    path: NotRequired[Annotated[str, Field(max_length=4096)]]
    load_s: NotRequired[Num]


Dim = Annotated[int, Field(ge=1, le=10_000_000)]


class ModelDescription(TypedDict):
    """What run.prepare found in a user's model (trainyard/sdk/prepare.py `describe`): the knowledge
    base's shape for it. Bounded: a job writes it."""
    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[misc]
    kind: Literal["user"]
    layers: Dim
    hidden: Dim
    heads: NotRequired[Optional[Dim]]
    seq_len: NotRequired[Optional[Dim]]
    vocab: NotRequired[Optional[Dim]]
    params: Annotated[int, Field(ge=1, le=10**13)]
    params_per_block: NotRequired[Annotated[int, Field(ge=0, le=10**13)]]
    blocks: NotRequired[Annotated[str, Field(max_length=200)]]


Text = Annotated[str, Field(max_length=2000)]
Seconds = Optional[Annotated[float, Field(ge=0, le=1e9)]]


class ChosenPlan(TypedDict):
    """The plan run.prepare's parallel auto chose (trainyard/sdk/autoplan.py CHOSEN)."""
    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[misc]
    dp: Dim
    tp: Dim
    pp: Dim
    micro_batch: Dim
    fsdp: bool
    shard_optimizer: bool
    recompute: Literal["none", "full"]
    step_time_s: Annotated[float, Field(ge=0, le=1e9)]
    memory_gb_per_device: Annotated[float, Field(ge=0, le=1e9)]
    tflops_per_device: Annotated[float, Field(ge=0, le=1e9)]
    explain: NotRequired[Text]


class RunnerUp(TypedDict):
    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[misc]
    label: Annotated[str, Field(max_length=200)]
    step_time_s: Seconds
    why: Text


class AutoChoice(TypedDict):
    """parallel auto for a user's model: what rank 0 planned; the job page shows it."""
    __pydantic_config__ = ConfigDict(extra="forbid", strict=True)  # type: ignore[misc]
    chosen: ChosenPlan
    runners_up: Annotated[list[RunnerUp], Field(max_length=10)]
    candidates: Annotated[int, Field(ge=1, le=10**7)]
    searched: Annotated[int, Field(ge=1, le=10**7)]
    constants_source: Annotated[str, Field(max_length=500)]
    flops_per_step: Annotated[float, Field(ge=0, le=1e30)]


class RankPlanEvent(Event):
    rank: Rank  # type: ignore[misc]
    model: NotRequired[ModelDescription]
    auto: NotRequired[AutoChoice]


class DroppedEvent(Event):
    count: Count


class RebalancedEvent(Event):
    """train.balance auto (trainyard/sdk/balance.py): rank 0's new split of the global batch."""
    step: Count
    counts: Annotated[list[Count], Field(min_length=1, max_length=4096)]
    previous: Annotated[list[Count], Field(min_length=1, max_length=4096)]
    shares: Annotated[list[Annotated[float, Field(ge=0, le=1)]], Field(max_length=4096)]
    speeds: Annotated[list[Annotated[float, Field(ge=0, le=1e12)]], Field(max_length=4096)]


class Log(TypedDict):
    __pydantic_config__ = _STRICT  # type: ignore[misc]
    attempt: NotRequired[Optional[Id]]
    rank: NotRequired[Optional[Rank]]
    stream: NotRequired[Literal["stdout", "stderr"]]
    node: NotRequired[Annotated[str, Field(max_length=255)]]
    lines: Annotated[list[str], Field(max_length=MAX_LOG_LINES)]


_SAMPLES = TypeAdapter(Annotated[list[Sample], Field(max_length=MAX_SAMPLES)])
_EVENT = TypeAdapter(Event)
_EVENTS = {"checkpoint": TypeAdapter(CheckpointEvent), "resumed": TypeAdapter(ResumedEvent),
           "rank_plan": TypeAdapter(RankPlanEvent), "telemetry_dropped": TypeAdapter(DroppedEvent),
           "rebalanced": TypeAdapter(RebalancedEvent)}
_LOG = TypeAdapter(Log)
KINDS = ("metrics", "event", "log")


class EntryError(ValueError):
    """Why an entry cannot be applied: the dead letter's reason."""


def stream_ids(stream: str) -> tuple[int, int] | None:
    """(job, attempt) a stream's name names, or None for any name `keys.attempt_stream` never makes."""
    m = _STREAM.fullmatch(stream)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _why(exc: ValidationError) -> str:
    errs = exc.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in errs[:3]]
    more = f" (+{len(errs) - 3} more)" if len(errs) > 3 else ""
    return "; ".join(parts) + more


_SAMPLE_NUMS = tuple(k for k in Sample.__annotations__ if k not in ("attempt", "rank", "step", "ts", "metrics"))
_SAMPLE_IDS = itemgetter("attempt", "rank", "step", "ts")
_NONE = type(None)
_INT, _NUM, _NUM_OR_NONE, _DICT_OR_NONE = {int}, {int, float}, {int, float, _NONE}, {dict, _NONE}


def samples_surely_valid(batches: list) -> bool:
    """True only if every one of `batches` (each an entry's decoded data) passes the metrics schema
    (_SAMPLES): checked over all of them at once (the set of the types of every value, of the required
    fields' columns, their min and max), ~0.4 us a sample where pydantic took ~1.5 us. False says nothing: the caller asks
    pydantic about each entry, for the same verdict and the same reason as ever."""
    for data in batches:
        if type(data) is not list or len(data) > MAX_SAMPLES:
            return False
    flat = [s for data in batches for s in data]
    if not flat:
        return True
    if set(map(type, flat)) != {dict}:
        return False
    try:
        attempt, rank, step, ts = zip(*map(_SAMPLE_IDS, flat))
    except KeyError:
        return False
    if not (set(map(type, attempt)) == set(map(type, rank)) == set(map(type, step)) == _INT
            and set(map(type, ts)) <= _NUM):
        return False
    if min(attempt) < 1 or max(attempt) >= 2**63 or min(rank) < 0 or max(rank) >= 2**31 \
            or min(step) < 0 or max(step) >= 2**63:
        return False
    if set(map(type, chain.from_iterable(map(dict.values, flat)))) <= _NUM_OR_NONE:
        return True  # every value of every key a number or null: the optional fields pass (one pass)
    for key in _SAMPLE_NUMS:
        if not set(map(type, map(dict.get, flat, repeat(key)))) <= _NUM_OR_NONE:
            return False
    return set(map(type, map(dict.get, flat, repeat("metrics")))) <= _DICT_OR_NONE


def validate_samples(data: Any) -> None:
    """Raise EntryError (the reason) unless `data` passes the metrics schema."""
    try:
        _SAMPLES.validate_python(data)
    except ValidationError as exc:
        raise EntryError(f"metrics entry: {_why(exc)}") from None


def parse_entry(fields: dict[bytes, bytes], *, check_samples: bool = True) -> tuple[str, Any]:
    """(kind, data) of a valid entry: data is a list of samples (metrics) or a dict (event, log).
    Raises EntryError saying what is wrong otherwise. check_samples=False leaves a metrics entry's
    schema to the caller (samples_surely_valid over a round's entries, else validate_samples)."""
    kind = fields.get(b"type", b"").decode("utf-8", "replace")
    raw = fields.get(b"data")
    if kind not in KINDS:
        raise EntryError(f"unknown entry type {kind[:40]!r}: expected one of {', '.join(KINDS)}")
    if raw is None:
        raise EntryError("no data field")
    if len(raw) > MAX_ENTRY_BYTES:
        raise EntryError(f"data is {len(raw)} bytes, over the {MAX_ENTRY_BYTES} byte limit")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise EntryError(f"data is not JSON: {str(exc)[:200]}") from None
    try:
        if kind == "metrics":
            if check_samples:
                _SAMPLES.validate_python(data)
        elif kind == "event":
            _EVENT.validate_python(data)
            adapter = _EVENTS.get(data["kind"])
            if adapter is not None:
                adapter.validate_python(data)
        else:
            _LOG.validate_python(data)
    except ValidationError as exc:
        raise EntryError(f"{kind} entry: {_why(exc)}") from None
    return kind, data


def entry_attempts(kind: str, data: Any) -> set[int]:
    """The attempts a valid entry names (each must be one of its stream's job's)."""
    if kind == "metrics":
        return {s["attempt"] for s in data}
    attempt = data.get("attempt")
    return {attempt} if attempt is not None else set()


def dead_letter(pipe, stream: str, entry_id: bytes | str, fields: dict[bytes, bytes], reason: str) -> None:
    """Queue the XADD of one refused entry to the dead-letter stream on `pipe` (approximate MAXLEN:
    Redis trims whole nodes, so the stream holds about DEADLETTER_MAXLEN entries)."""
    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    data = fields.get(b"data") or b""
    pipe.xadd(keys.DEADLETTER_STREAM, {
        "stream": stream[:200], "id": eid, "type": (fields.get(b"type") or b"")[:40],
        "data": data[:DEADLETTER_DATA_MAX], "data_bytes": len(data), "reason": reason[:REASON_MAX],
        "unixtime": f"{time.time():.3f}"}, maxlen=DEADLETTER_MAXLEN, approximate=True)


def read_dead_letters(client, count: int = 100) -> list[dict[str, Any]]:
    """The newest dead letters first, as strings (for the staff page)."""
    out = []
    for entry_id, fields in client.xrevrange(keys.DEADLETTER_STREAM, count=count):
        row = {k.decode(): v.decode("utf-8", "replace") for k, v in fields.items()}
        row["dead_letter_id"] = entry_id.decode()
        out.append(row)
    return out
