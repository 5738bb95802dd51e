"""deploy/grafana/trainyard.json, the operators' Grafana dashboard: every expression of every panel
(and of the template variables) names only metrics that /metrics really exports, rendered from a
populated database and a real Redis; every panel has a title, the Prometheus datasource variable and
a query; panel ids are unique.

The metric names of an expression come from a small PromQL tokenizer (no PromQL parser is installed,
and none is worth a dependency): identifiers that are not functions (followed by `(`), aggregation
operators or keywords, outside label matchers `{...}`, range and subquery brackets `[...]`, strings,
and the label lists of by/without/on/ignoring/group_left/group_right."""
from __future__ import annotations

import copy
import json
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from jobs import services
from jobs.core import dispatch
from jobs.models import Attempt, ControlPlaneClock, Job, Quota
from jobs.telemetry import prometheus
from tests.jobs import conftest as jobs_conftest
from tests.jobs.telemetry.test_prometheus import parse
from tests.nodes import node_up
from trainyard.keys import RELAY_GROUP, RELAY_STATS_KEY, attempt_stream

# tests/jobs/'s fixtures (its conftest.py does not reach this directory): users, teams, nodes, and the
# autouse stubs of Celery sends (`sent`) and slow password hashing
user, other, staff, teams, nodes = (jobs_conftest.user, jobs_conftest.other, jobs_conftest.staff,
                                    jobs_conftest.teams, jobs_conftest.nodes)
sent, _fast_passwords = jobs_conftest.sent, jobs_conftest._fast_passwords

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "trainyard.json"
RECORD = dispatch.scheduler_tick_record  # the real one (the `sent` fixture stubs it out)

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
                "topk", "quantile", "limitk", "limit_ratio"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = AGGREGATIONS | LABEL_LISTS | {"bool", "offset", "and", "or", "unless", "atan2", "inf", "nan"}
FUNCTIONS = {
    "abs", "absent", "absent_over_time", "acos", "acosh", "asin", "asinh", "atan", "atanh", "avg_over_time",
    "ceil", "changes", "clamp", "clamp_max", "clamp_min", "cos", "cosh", "count_over_time", "day_of_month",
    "day_of_week", "day_of_year", "days_in_month", "deg", "delta", "deriv", "exp", "floor", "histogram_avg",
    "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev", "histogram_stdvar",
    "histogram_sum", "holt_winters", "hour", "idelta", "increase", "irate", "label_join", "label_replace", "last_over_time",
    "ln", "log10", "log2", "mad_over_time", "max_over_time", "min_over_time", "minute", "month", "pi",
    "predict_linear", "present_over_time", "quantile_over_time", "rad", "rate", "resets", "round", "scalar", "sgn",
    "sin", "sinh", "sort", "sort_by_label", "sort_by_label_desc", "sort_desc", "sqrt", "stddev_over_time",
    "stdvar_over_time", "sum_over_time", "tan", "tanh", "time", "timestamp", "vector", "year", "start", "end",
    # Grafana's template-variable query functions
    "label_values", "label_names", "metrics", "query_result",
}
TOKEN = re.compile(r"""\s+|(?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)|(?P<num>\d[\w.]*|\.\d\w*)"""
                   r"""|(?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)|(?P<punct>[{}()\[\],])|(?P<op>.)""", re.S)
GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")


def tokens(expr: str) -> list[tuple[str, str]]:
    out = []
    for m in TOKEN.finditer(GRAFANA_VAR.sub(" 0 ", expr)):
        if m.lastgroup:
            out.append((m.lastgroup, m.group(m.lastgroup)))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names an expression (PromQL, or a Grafana variable query) selects."""
    toks = tokens(expr)
    names: set[str] = set()
    i, braces, brackets = 0, 0, 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if text == "{":
            braces += 1
        elif text == "}":
            braces -= 1
        elif text == "[":
            brackets += 1
        elif text == "]":
            brackets -= 1
        elif braces or brackets:
            pass
        elif kind == "ident":
            if text in LABEL_LISTS and nxt == "(":
                i = _close(toks, i + 1)
            elif nxt == "(":
                assert text in FUNCTIONS or text in AGGREGATIONS, f"unknown function {text}() in {expr!r}"
            elif text not in KEYWORDS:
                names.add(text)
        i += 1
    assert braces == 0 and brackets == 0, f"unbalanced {{}} or [] in {expr!r}"
    return names


def _close(toks, open_at: int) -> int:
    """Index of the `)` matching the `(` at open_at."""
    depth = 0
    for j in range(open_at, len(toks)):
        depth += {"(": 1, ")": -1}.get(toks[j][1], 0)
        if depth == 0:
            return j
    raise AssertionError("unbalanced ()")


def exported_names(exposition: str) -> set[str]:
    """What a PromQL query may select from the exposition: each family named by a `# TYPE name kind`
    line; a counter also under name_total (the OpenMetrics family name); a histogram or summary only
    as its name_bucket (histogram), name_sum and name_count series (a summary also as name)."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.M):
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif kind == "summary":
            names |= {name, f"{name}_sum", f"{name}_count"}
        elif kind == "counter" and not name.endswith("_total"):
            names |= {name, f"{name}_total"}
        else:
            names.add(name)
    return names


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # a collapsed row keeps its panels inside it
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expression) of every panel target and every query template variable."""
    out = [(f"panel {p['id']} {p.get('title')!r} {t.get('refId')}", t.get("expr", ""))
           for p in all_panels(dashboard) if p.get("type") != "row" for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var.get("query"), dict) else var.get("query", "")
            # label_values(<selector>, <label>): the label is no metric
            out.append((f"variable {var['name']}", re.sub(r",\s*[a-zA-Z_]\w*\s*\)\s*$", ")", q)))
    return out


def problems(dashboard: dict, exported: set[str]) -> list[str]:
    found = []
    for where, expr in queries(dashboard):
        if not expr.strip():
            found.append(f"{where}: no expression")
            continue
        names = metric_names(expr)
        if not names:
            found.append(f"{where}: names no metric: {expr!r}")
        found += [f"{where}: {name} is not exported by /metrics" for name in sorted(names - exported)]
    return found


def load() -> dict:
    return json.loads(DASHBOARD.read_text())


# ---------------------------------------------------------------- the dashboard's shape

def test_every_panel_has_a_title_the_datasource_variable_and_a_query_and_ids_are_unique():
    dash = load()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds_var = variables["DS_PROMETHEUS"]
    assert ds_var["type"] == "datasource" and ds_var["query"] == "prometheus"
    ds = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    panels = all_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36  # Grafana 10's is 38/39
    for p in panels:
        assert p.get("title"), f"panel {p['id']} has no title"
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, (p["title"], g)
        if p["type"] == "row":
            continue
        assert p.get("datasource") == ds, f"panel {p['title']!r}: datasource {p.get('datasource')}"
        assert p.get("targets"), f"panel {p['title']!r} has no target"
        for t in p["targets"]:
            assert t.get("expr") and t.get("refId"), (p["title"], t)
            assert t.get("datasource", ds) == ds, (p["title"], t)
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"] == ds, v["name"]
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert len(rows) == 4, rows  # relay, scheduler and queue, nodes and GPUs, processes


# ---------------------------------------------------------------- the tokenizer

@pytest.mark.parametrize("expr, names", [
    ("rate(trainyard_relay_samples_total[$__rate_interval])", {"trainyard_relay_samples_total"}),
    ("histogram_quantile(0.95, sum by (le) (rate(a_bucket[5m])))", {"a_bucket"}),
    ("sum(rate(a_total[1m:10s] offset 5m)) by (job, le) / ignoring(x) b", {"a_total", "b"}),
    ('up{job=~"a|b", le!="1"} * on (node) group_left (status) (c{status!="READY"} == bool 1)', {"up", "c"}),
    ('time() - last_ts{team=~"$team"} > 0 and d unless e or f', {"last_ts", "d", "e", "f"}),
    ("topk(3, max without (gpu) (g)) @ end()", {"g"}),
    ('label_values(trainyard_team_queue_length{team!=""})', {"trainyard_team_queue_length"}),
    ("1 + 2e3 * inf", set()),
    ("'x' and `y` and \"z\\\"w\" and name:recorded", {"name:recorded"}),
])
def test_metric_names_of_an_expression(expr, names):
    assert metric_names(expr) == names


def test_an_unknown_function_or_unbalanced_brackets_fail():
    with pytest.raises(AssertionError, match="unknown function"):
        metric_names("rat(x[5m])")
    with pytest.raises(AssertionError, match="unbalanced"):
        metric_names("x{a=\"b\"")


def test_exported_names_follow_the_type_lines():
    text = ("# TYPE a gauge\na 1\n# TYPE b_total counter\nb_total 1\n# TYPE c counter\nc 1\n"
            "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n")
    assert exported_names(text) == {"a", "b_total", "c", "c_total", "h_bucket", "h_sum", "h_count"}


def test_a_panel_naming_a_metric_that_does_not_exist_is_caught():
    dash = load()
    exported = {name for _, expr in queries(dash) for name in metric_names(expr)}
    assert problems(dash, exported) == []
    broken = copy.deepcopy(dash)
    target = next(p for p in broken["panels"] if p["type"] != "row")["targets"][0]
    target["expr"] = target["expr"].replace("trainyard_relay_samples_total", "trainyard_relay_sample_total")
    assert problems(broken, exported) == [
        "panel 2 'Relay rate' A: trainyard_relay_sample_total is not exported by /metrics"]
    # a histogram is selected through its series, never under its family's bare name
    target["expr"] = "rate(trainyard_scheduler_tick_duration_seconds[5m])"
    assert "trainyard_scheduler_tick_duration_seconds is not exported" in problems(
        broken, exported_names("# TYPE trainyard_scheduler_tick_duration_seconds histogram\n") | exported)[0]


# ---------------------------------------------------------------- against a real /metrics

@pytest.fixture
def populated(staff, user, other, teams, nodes, redis_server, settings, monkeypatch, tmp_path):
    """A cluster with something in every family: GPUs (one with an ECC error), a running job with
    telemetry, queued jobs of two teams and one without, a preempted-and-requeued job, a quota, a
    node check's clock, refused reports, the relay's counters and a stream with a pending entry, two
    schedule ticks recorded in a real Redis, and make run's supervisor file."""
    settings.REDIS_URL = redis_server.url
    monkeypatch.setattr(prometheus, "_redis", None)
    monkeypatch.setattr(dispatch, "scheduler_tick_record", RECORD)
    monkeypatch.setenv("TRAINYARD_VAR_DIR", str(tmp_path))
    r = redis.Redis.from_url(redis_server.url)

    gpu = {"kind": "cuda", "index": 0, "name": "NVIDIA H200", "memory_bytes": 141 * 2**30,
           "memory_used_bytes": 12 * 2**30, "utilization": 37, "nvml_index": 0, "uuid": "GPU-0",
           "temperature_c": 41, "ecc_uncorrected": 0, "xid_supported": True, "xid_errors": 0, "xid_events": []}
    node_up({"name": "node-g", "address": "127.0.0.3", "slots": 2, "devices": [gpu, {**gpu, "index": 1, "uuid": "GPU-1"}]})
    Quota.objects.create(team=Group.objects.create(name="ops"), max_slots=2)
    running = services.job_submit(user=user, spec=services.submitted_spec(
        {"name": "run", "resources": {"nodes": 2, "procs_per_node": 2}}))
    services.schedule_tick()
    attempt = running.attempts.get()  # 4 of the 6 slots: the 4-slot jobs below wait
    services.telemetry_ingest([{"rank": 0, "step": 1, "ts": time.time(), "loss": 3.0, "samples_per_s": 50.0,
                                "attempt": attempt.pk}], events=[])
    for owner, name in ((user, "v-wait"), (other, "n-wait"), (staff, "lone")):
        services.job_submit(user=owner, spec=services.submitted_spec(
            {"name": name, "resources": {"nodes": 2, "procs_per_node": 2}}))
    requeued = services.job_submit(user=other, spec=services.submitted_spec(
        {"name": "requeued", "resources": {"nodes": 2, "procs_per_node": 2}}))
    Attempt.objects.create(job=requeued, number=1, status=Attempt.Status.ENDED, outcome="preempted",
                           ended_at=timezone.now() - timedelta(seconds=30))
    services.schedule_tick()  # nothing more fits: they stay queued
    assert Job.objects.filter(status=Job.Status.QUEUED).count() == 4
    ControlPlaneClock.objects.update_or_create(pk=1, defaults={"last_check_at": timezone.now(),
                                                               "healthy_since": timezone.now() - timedelta(hours=1)})
    services.security_event("bad_signature", "node-x", "test")

    r.hset(RELAY_STATS_KEY, mapping={"samples_total": 100, "entries_total": 10, "batches_total": 5,
                                     "deadletter_total": 1, "last_batch_unixtime": time.time(),
                                     "last_batch_samples": 4, "last_batch_seconds": 0.002,
                                     "started_unixtime": time.time() - 60})
    stream = attempt_stream(running.pk, attempt.pk)
    r.xgroup_create(stream, RELAY_GROUP, id="0", mkstream=True)
    r.xadd(stream, {"type": "metrics", "data": "[]"})
    r.xreadgroup(RELAY_GROUP, "relay-1", {stream: ">"}, count=1)
    r.xadd("trainyard:relay:deadletter", {"reason": "test"})
    (tmp_path / "supervisor.json").write_text(json.dumps({"supervisor_pid": 1, "updated_at": time.time(), "processes": {
        "web": {"pid": 4242, "running": True, "restarts": 1, "last_exit": None}}}))

    c = Client()
    c.force_login(staff)
    resp = c.get("/metrics")
    assert resp.status_code == 200
    return resp.content.decode()


@pytest.mark.procs
@pytest.mark.django_db
def test_every_expression_names_only_metrics_that_metrics_exports(populated):
    fams = parse(populated)  # strict: the exposition itself is well-formed
    exported = exported_names(populated)
    found = problems(load(), exported)
    assert not found, "\n".join(found)
    # the page really was populated: the families the dashboard's rows are about carry samples
    for name in ("trainyard_relay_samples_total", "trainyard_relay_pending_oldest_age_seconds",
                 "trainyard_scheduler_tick_duration_seconds", "trainyard_team_queue_length",
                 "trainyard_team_queue_oldest_wait_seconds", "trainyard_node_status",
                 "trainyard_node_gpu_temperature_celsius", "trainyard_process_up", "trainyard_process_restarts_total",
                 "trainyard_job_samples_per_second"):
        assert fams[name].get("samples"), name
    labelled = {lab["team"] for lab, _ in fams["trainyard_team_queue_length"]["samples"]}
    assert labelled == {"vision", "nlp", "ops", prometheus.NO_TEAM}
    # and every metric the dashboard uses is one of them (none is only declared by a test double)
    used = {name for _, expr in queries(load()) for name in metric_names(expr)}
    assert used <= exported
