"""REST API: auth, visibility, bad input (400 with field errors, nothing created), shapes."""
import pytest
from django.core.management import call_command
from rest_framework.test import APIClient

from jobs.core import errors
from jobs import services
from jobs.core.api_errors import exception_handler
from jobs.models import Job
from trainyard.spec import SpecError

pytestmark = pytest.mark.django_db


def test_anonymous_is_refused(nodes):
    c = APIClient()
    for url in ("/api/v1/jobs/", "/api/v1/nodes/", "/api/v1/jobs/1/metrics/", "/api/schema/"):
        assert c.get(url).status_code in (401, 403), url
    assert c.post("/api/v1/jobs/", {"name": "x"}, format="json").status_code in (401, 403)
    assert Job.objects.count() == 0


def test_token_auth_and_api_token_command(user, nodes, capsys):
    call_command("api_token", "alice")
    key = capsys.readouterr().out.strip()
    assert len(key) == 43  # 32 random bytes, urlsafe base64
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {key}")
    r = c.post("/api/v1/jobs/", {"name": "demo"}, format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["status"] == "QUEUED" and body["owner"] == "alice" and body["spec"]["model"]["kind"] == "gpt"
    assert body["queue_position"] == 1 and body["attempts"] == []
    c.credentials(HTTP_AUTHORIZATION="Token wrong")
    assert c.get("/api/v1/jobs/").status_code == 401


BAD = [
    ({"name": "x", "model": {"hidden": "big"}}, "model.hidden"),
    ({"name": "x", "bogus": 1}, "bogus"),
    ({"name": "x", "model": {"kind": "rnn"}}, "model.kind"),
    ({"name": "x", "data": {"kind": "images"}}, "data.kind"),
    ({"name": "x", "train": {"steps": 0}}, "train.steps"),
    ({"name": "x", "train": {"steps": -5}}, "train.steps"),
    ({"name": "x", "model": {"layers": 200, "hidden": 60000, "heads": 4}}, "model"),
    ({"name": "x", "resources": {"nodes": 40}, "parallel": {"dp": 40}, "train": {"global_batch": 40}}, "resources"),
    ({"name": "x", "data": {"kind": "tokens", "path": "../../etc/passwd"}}, "data.path"),
    ({"name": "x", "data": {"kind": "tokens", "path": "/etc/passwd"}}, "data.path"),
    ({"name": "x", "parallel": {"tp": 3, "dp": 1}, "resources": {"nodes": 1, "procs_per_node": 3}}, "parallel.tp"),
    ({"name": "x", "parallel": {"pp": 2, "dp": 1, "microbatches": 3}}, "parallel.microbatches"),
    ({"name": "x", "parallel": {"fsdp": True}, "comm": {"compression": "fp16"}}, "comm.compression"),
    ({"name": "x", "comm": {"compression": "zip"}}, "comm.compression"),
    ({"name": "x", "comm": {"compression": "topk", "ratio": 0}}, "comm.ratio"),
    ({"name": "x", "comm": {"compression": "fp16", "ratio": "auto"}}, "comm.ratio"),
    ({"name": "x", "comm": {"compression": "powersgd", "rank": 0}}, "comm.rank"),
    ({"name": "x", "comm": {"sync": "hierarchical"}}, "comm.sync"),
    ({"name": "x", "train": {"balance": "auto"}, "parallel": {"fsdp": True}}, "train.balance"),
    ({"name": "x", "train": {"grad_accum": 0}}, "train.grad_accum"),
    ({"name": "x", "train": {"grad_accum": 3}}, "train.global_batch"),
    ({"name": "x", "train": {"global_batch": 31}}, "train.global_batch"),
    ({"model": {}}, "name"),
    ({"name": "x", "priority": "urgent"}, "priority"),
]


@pytest.mark.parametrize("spec,field", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_spec_is_400_with_field_error_and_creates_nothing(user, nodes, client_for, spec, field):
    r = client_for(user).post("/api/v1/jobs/", spec, format="json")
    assert r.status_code == 400, r.content
    errors = r.json()["errors"]
    assert field in errors, errors
    assert all(isinstance(m, str) and m for m in errors[field])
    assert Job.objects.count() == 0


def test_an_impossible_combination_says_which_field_and_why(user, nodes, client_for):
    r = client_for(user).post("/api/v1/jobs/", {"name": "x", "parallel": {"pp": 2, "dp": 1},
                                                "comm": {"compression": "powersgd"}}, format="json")
    assert r.status_code == 400
    assert r.json()["errors"] == {"comm.compression": [
        "gradient compression is a DDP comm hook: it needs plain data parallelism (tp 1, pp 1, fsdp false)"]}


def test_non_object_body_is_400(user, nodes, client_for):
    r = client_for(user).post("/api/v1/jobs/", [1, 2], format="json")
    assert r.status_code == 400 and "errors" in r.json()


def test_users_see_only_their_jobs_staff_sees_all(user, other, staff, nodes, client_for):
    mine = services.job_submit(user=user, spec=services.submitted_spec({"name": "mine"}))
    theirs = services.job_submit(user=other, spec=services.submitted_spec({"name": "theirs"}))
    c = client_for(user)
    ids = [j["id"] for j in c.get("/api/v1/jobs/").json()["results"]]
    assert ids == [mine.pk]
    assert c.get(f"/api/v1/jobs/{theirs.pk}/").status_code == 404
    assert c.get(f"/api/v1/jobs/{theirs.pk}/metrics/").status_code == 404
    assert c.post(f"/api/v1/jobs/{theirs.pk}/cancel/").status_code == 404
    assert Job.objects.get(pk=theirs.pk).status == "QUEUED"
    all_ids = {j["id"] for j in client_for(staff).get("/api/v1/jobs/").json()["results"]}
    assert all_ids == {mine.pk, theirs.pk}


def test_cancel_endpoint(user, nodes, client_for):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "x"}))
    c = client_for(user)
    assert c.post(f"/api/v1/jobs/{job.pk}/cancel/").status_code == 202
    assert Job.objects.get(pk=job.pk).status == "CANCELLED"
    r = c.post(f"/api/v1/jobs/{job.pk}/cancel/")
    assert r.status_code == 409 and "status" in r.json()["errors"]


def test_metrics_shape_and_filters(user, nodes, client_for):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "x"}))
    services.schedule_tick()
    attempt = job.attempts.get()
    services.telemetry_ingest([
        {"rank": r, "step": s, "ts": 1764471234.0 + s, "loss": 3.0, "samples_per_s": 1.0, "tokens_per_s": 2.0,
         "step_s": 0.1, "data_s": 0.0, "compute_s": 0.05, "comm_s": 0.01, "optim_s": 0.01, "bytes_sent": 4,
         "mem_bytes": 8, "attempt": attempt.pk} for s in range(1, 11) for r in (0, 1)], events=[])
    c = client_for(user)
    sample_fields = {"rank", "step", "ts", "loss", "samples_per_s", "tokens_per_s", "step_s", "data_s",
                     "compute_s", "comm_s", "optim_s", "bytes_sent", "mem_bytes", "compression_ratio", "share",
                     "attempt", "metrics"}
    # default: one row per step, every rank reduced; a sample's field names hold the means (issue 26)
    rows = c.get(f"/api/v1/jobs/{job.pk}/metrics/").json()
    assert isinstance(rows, list) and [x["step"] for x in rows] == list(range(1, 11))
    assert sample_fields < set(rows[0]) and {"ranks", "loss_min", "loss_max", "loss_n", "step_s_max_rank",
                                             "metrics_rank"} < set(rows[0])
    assert rows[0]["rank"] is None and rows[0]["ranks"] == 2 and rows[0]["metrics"] is None
    assert rows[0]["loss"] == rows[0]["loss_min"] == rows[0]["loss_max"] == 3.0 and rows[0]["bytes_sent"] == 4
    assert rows[0]["loss_n"] == 2 and rows[0]["share_n"] == 0 and rows[0]["share"] is None
    rows = c.get(f"/api/v1/jobs/{job.pk}/metrics/?per_rank=true").json()
    assert len(rows) == 20 and set(rows[0]) == sample_fields and rows[0]["metrics"] is None
    assert [(x["step"], x["rank"]) for x in rows[:3]] == [(1, 0), (1, 1), (2, 0)]
    rows = c.get(f"/api/v1/jobs/{job.pk}/metrics/?since_step=8&rank=1&limit=5").json()
    assert [(x["step"], x["rank"]) for x in rows] == [(9, 1), (10, 1)]
    assert [x["step"] for x in c.get(f"/api/v1/jobs/{job.pk}/metrics/?since_step=8").json()] == [9, 10]
    for bad in ("since_step=abc", "limit=0", "limit=999999", "rank=-1", "per_rank=maybe"):
        r = c.get(f"/api/v1/jobs/{job.pk}/metrics/?{bad}")
        assert r.status_code == 400 and r.json()["errors"], bad


def test_nodes_list_shape(user, nodes, client_for):
    body = client_for(user).get("/api/v1/nodes/").json()
    assert body["count"] == 2
    a = body["results"][0]
    assert a["name"] == "node-a" and a["status"] == "READY" and a["slots"] == 2 and a["slots_used"] == 0
    assert a["address"] == "127.0.0.1" and a["labels"] == {"rack": "r1"}


def test_schema_is_served(user, client_for):
    r = client_for(user).get("/api/schema/")
    assert r.status_code == 200 and b"/api/v1/jobs/" in r.content


@pytest.mark.parametrize("exc,status,body", [
    (errors.InvalidInput({"pinned": ["must be true or false"]}), 400, {"pinned": ["must be true or false"]}),
    (errors.QuotaError({"0.max_slots": ["required"]}), 400, {"0.max_slots": ["required"]}),
    (errors.NodeActionError({"mode": ["bad"]}), 400, {"mode": ["bad"]}),
    (errors.RollbackCheckpointError("gone"), 400, {"checkpoint": ["gone"]}),
    (errors.Forbidden("only staff may pin checkpoints"), 403, {"detail": ["only staff may pin checkpoints"]}),
    (errors.NotFound({"node": ["no node named 'x'"]}), 404, {"node": ["no node named 'x'"]}),
    (errors.TransitionError("job is already SUCCEEDED"), 409, {"status": ["job is already SUCCEEDED"]}),
    (errors.TransitionError("deleted", field="checkpoint"), 409, {"checkpoint": ["deleted"]}),
    (SpecError({"train.steps": ["too big"]}), 400, {"train.steps": ["too big"]}),
])
def test_one_exception_handler_maps_each_domain_error(exc, status, body):
    r = exception_handler(exc, {})
    assert r.status_code == status and r.data == {"errors": body}
