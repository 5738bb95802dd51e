"""The planner's front doors: POST /api/v1/plan/ (login required, 400 naming the fields) and
`python manage.py plan` (stdin JSON -> one JSON document; bad input one line, exit code 2)."""
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from jobs.planning.constants import constants_for
from trainyard.plan import DEFAULT_CPU, DEFAULT_GPU
from tests import postgres

REPO = Path(__file__).resolve().parents[3]
REQUEST = {"model": {"layers": 4, "hidden": 128, "heads": 4, "seq_len": 64, "vocab": 256},
           "cluster": {"nodes": 2, "devices_per_node": 2, "device": {"name": "cpu", "memory_gb": 4, "peak_tflops": 0.05},
                       "intra_node_gbs": 5, "inter_node_gbs": 1},
           "global_batch": 16, "fix": {"pp": 1}}


@pytest.mark.django_db
def test_constants_for_device_names():
    assert constants_for("cpu") is DEFAULT_CPU and constants_for(" CPU ") is DEFAULT_CPU
    assert constants_for("A100-80GB") is DEFAULT_GPU


@pytest.mark.django_db
def test_api_needs_a_login(client):
    r = client.post("/api/v1/plan/", REQUEST, content_type="application/json")
    assert r.status_code in (401, 403) and "errors" in r.json()


@pytest.mark.django_db
def test_api_plans_for_a_logged_in_user(user, client_for):
    r = client_for(user).post("/api/v1/plan/", REQUEST, format="json")
    assert r.status_code == 200, r.content
    body = r.json()
    assert set(body) == {"plans", "rejected"} and body["plans"]
    assert all(p["pp"] == 1 and p["dp"] * p["tp"] == 4 for p in body["plans"])
    times = [p["step_time_s"] for p in body["plans"]]
    assert times == sorted(times) and isinstance(body["plans"][0]["explain"], str)


@pytest.mark.django_db
def test_api_bad_input_is_a_400_naming_each_field(user, client_for):
    bad = {**REQUEST, "model": {**REQUEST["model"], "heads": 3, "layers": 0},
           "cluster": {**REQUEST["cluster"], "nodes": 1_000_000}, "fix": {"dp": 1, "tp": 1, "pp": 1}}
    r = client_for(user).post("/api/v1/plan/", bad, format="json")
    assert r.status_code == 400
    errors = r.json()["errors"]
    assert {"model.layers", "cluster.nodes"} <= set(errors)
    r = client_for(user).post("/api/v1/plan/", {**REQUEST, "fix": {"dp": 1, "tp": 1, "pp": 1}}, format="json")
    assert r.status_code == 400 and "dp*tp*pp = 1" in r.json()["errors"]["fix"][0]
    r = client_for(user).post("/api/v1/plan/", [1, 2], format="json")
    assert r.status_code == 400 and "request" in r.json()["errors"]


@pytest.mark.django_db
def test_plan_command_prints_one_json_document():
    out, err = io.StringIO(), io.StringIO()
    stdin = sys.stdin
    try:
        sys.stdin = io.StringIO(json.dumps(REQUEST))
        call_command("plan", stdout=out, stderr=err)
    finally:
        sys.stdin = stdin
    doc = json.loads(out.getvalue())
    assert doc["plans"] and "planned 4 devices" in err.getvalue()


def test_plan_command_bad_input_raises_exit_code_2():
    stdin = sys.stdin
    try:
        for text in ("{not json", json.dumps({**REQUEST, "global_batch": 0})):
            sys.stdin = io.StringIO(text)
            with pytest.raises(CommandError) as exc:
                call_command("plan", stdout=io.StringIO(), stderr=io.StringIO())
            assert exc.value.returncode == 2
    finally:
        sys.stdin = stdin
    assert "global_batch" in str(exc.value)


@pytest.mark.procs
def test_manage_py_plan_process_bad_input_one_line_exit_2(tmp_path):
    # the command reads the newest calibration: a migrated database of its own
    env = {**os.environ, **postgres.fresh_database_env(tmp_path / "db.sqlite3")}
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=300)
    bad = json.dumps({**REQUEST, "model": {**REQUEST["model"], "heads": 3}})
    r = subprocess.run([sys.executable, "manage.py", "plan"], cwd=REPO, input=bad, capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.heads: 3 heads do not divide hidden 128" in lines[0]
    ok = subprocess.run([sys.executable, "manage.py", "plan"], cwd=REPO, input=json.dumps(REQUEST),
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["plans"]


@pytest.mark.procs
def test_manage_py_plan_before_migrate_plans_with_the_default_constants_and_says_so(tmp_path):
    """A fresh clone's first `python manage.py plan` (no migrate yet) crashed with a traceback
    (no such table: jobs_calibration)."""
    env = {**os.environ, **postgres.fresh_database_env(tmp_path / "db.sqlite3")}
    r = subprocess.run([sys.executable, "manage.py", "plan"], cwd=REPO, input=json.dumps(REQUEST),
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plans"] and "Traceback" not in r.stderr
    assert "run `python manage.py migrate` first" in r.stderr and "planning with the default constants" in r.stderr
