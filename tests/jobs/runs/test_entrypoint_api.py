"""Submitting an entrypoint job (the user's own code) through the API, the form and the services:
the bundle and script checks, the stored spec and plan, the job page, and hang detection of a
script that never reports a step."""
import io
import tarfile
from datetime import timedelta

import pytest
from django.utils import timezone

from jobs.attempts import selectors
from jobs import services
from jobs.models import Attempt, CodeBundle, Job, JobEvent

from tests.jobs.runs.test_services import start

pytestmark = pytest.mark.django_db

FILES = ("train.py", "src/model.py", "README.md")


def targz(files) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in files:
            data = f"# {name}\n".encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture
def bundle(user, client_for, settings, tmp_path):
    """The digest of a bundle holding FILES, uploaded through POST /api/v1/code/ as a user would."""
    settings.TRAINYARD_ARTIFACT_ROOT = tmp_path / "artifacts"
    f = io.BytesIO(targz(FILES))
    f.name = "code.tar.gz"
    r = client_for(user).post("/api/v1/code/", {"file": f}, format="multipart")
    assert r.status_code == 201, r.content
    assert r.json()["files"] == len(FILES)
    return r.json()["bundle"]


def entry_spec(bundle, **kw):
    return {"name": "mine", "code": {"bundle": bundle}, "entrypoint": {"script": "train.py", "args": ["--lr", "3e-4"]},
            "config": {"lr": 0.0003}, "env": {"HF_HOME": "/data/hf"}, **kw}


def test_an_entrypoint_job_with_a_stored_bundle_is_201(user, nodes, client_for, bundle):
    r = client_for(user).post("/api/v1/jobs/", entry_spec(bundle), format="json")
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["spec"]["model"] is None and body["spec"]["data"] is None
    assert body["spec"]["entrypoint"] == {"script": "train.py", "module": None, "args": ["--lr", "3e-4"]}
    assert body["spec"]["code"] == {"bundle": bundle} and body["spec"]["env"] == {"HF_HOME": "/data/hf"}
    assert body["plan"]["user_code"] and body["plan"]["strategy"] == "dp 2"
    assert [x["role"] for x in body["plan"]["roles"]] == ["data-parallel replica 0/2", "data-parallel replica 1/2"]
    # never ran: nothing to predict from (no model shape to count FLOPs of)
    assert body["predicted_s"] is None and body["plan"]["prediction_source"] == "none"
    job = Job.objects.get()
    assert job.spec == body["spec"] and job.slots == 2 and job.total_steps == 200


def test_a_bundle_whose_file_is_gone_is_unknown(user, nodes, client_for, bundle):
    from jobs.bundles.services import bundle_file

    bundle_file(bundle).chmod(0o644)
    bundle_file(bundle).unlink()
    r = client_for(user).post("/api/v1/jobs/", entry_spec(bundle), format="json")
    assert r.status_code == 400 and "code.bundle" in r.json()["errors"]
    assert Job.objects.count() == 0


def test_submitting_marks_the_bundle_used(user, nodes, bundle):
    CodeBundle.objects.update(last_used_at=None)
    services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle)))
    assert CodeBundle.objects.get(digest=bundle).last_used_at is not None


def test_a_module_entrypoint_is_not_looked_up_in_the_bundle(user, nodes, bundle):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "m", "code": {"bundle": bundle},
                                               "entrypoint": {"module": "mypkg.train"}}))
    assert job.spec["entrypoint"]["module"] == "mypkg.train"


def test_a_script_in_a_subdirectory_is_found_normalized(user, nodes, bundle):
    job = services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle, entrypoint={"script": "./src/model.py"})))
    assert job.spec["entrypoint"]["script"] == "src/model.py"


BAD = [
    ("unknown bundle", lambda b: entry_spec("sha256:" + "11" * 32), "code.bundle", "no code bundle"),
    ("malformed bundle", lambda b: entry_spec("sha256:xyz"), "code.bundle", "64 lowercase hex"),
    ("script missing from the bundle", lambda b: entry_spec(b, entrypoint={"script": "nope.py"}),
     "entrypoint.script", "nope.py is not a file in bundle"),
    ("a directory is not a script", lambda b: entry_spec(b, entrypoint={"script": "src"}),
     "entrypoint.script", "is not a file in bundle"),
    ("both model and entrypoint", lambda b: entry_spec(b, model={"kind": "gpt"}), "model", "exclude each other"),
    ("both data and entrypoint", lambda b: entry_spec(b, data={"kind": "demo"}), "data", "remove data"),
    ("a torchrun env name", lambda b: entry_spec(b, env={"RANK": "3"}), "env", "set by torchrun"),
    ("a Trainyard env name", lambda b: entry_spec(b, env={"TRAINYARD_RUN_CONFIG": "/x"}), "env", "cannot be set"),
    ("LD_PRELOAD", lambda b: entry_spec(b, env={"LD_PRELOAD": "/x.so"}), "env", "cannot be set"),
    ("a relative python", lambda b: entry_spec(b, python="venv/bin/python"), "python", "absolute path"),
    ("pipeline parallel for user code", lambda b: entry_spec(b, parallel={"pp": 2, "dp": 1}), "parallel",
     "has no pipeline stages"),
    ("an oversized config", lambda b: entry_spec(b, config={"x": "y" * 70000}), "config", "the limit is 65536"),
    ("code without an entrypoint", lambda b: {"name": "x", "code": {"bundle": b}}, "code", "add entrypoint"),
]


@pytest.mark.parametrize("desc,make,field,message", BAD, ids=[b[0] for b in BAD])
def test_bad_entrypoint_specs_are_400_naming_the_field_and_store_nothing(user, nodes, client_for, bundle,
                                                                         desc, make, field, message):
    r = client_for(user).post("/api/v1/jobs/", make(bundle), format="json")
    assert r.status_code == 400, r.content
    errors = r.json()["errors"]
    assert field in errors and any(message in m for m in errors[field]), errors
    assert Job.objects.count() == 0 and JobEvent.objects.count() == 0


def test_the_missing_script_message_lists_the_bundles_python_files(user, nodes, client_for, bundle):
    r = client_for(user).post("/api/v1/jobs/", entry_spec(bundle, entrypoint={"script": "trian.py"}), format="json")
    assert r.json()["errors"]["entrypoint.script"] == [
        f"trian.py is not a file in bundle {bundle[:19]}...; its Python files include src/model.py, train.py"]


def test_the_submit_form_accepts_an_entrypoint_spec(user, nodes, client, bundle):
    import yaml

    client.force_login(user)
    r = client.post("/jobs/new/", {"spec": yaml.safe_dump(entry_spec(bundle))})
    assert r.status_code == 302, r.content.decode()[:2000]
    job = Job.objects.get()
    assert job.spec["entrypoint"]["script"] == "train.py" and job.spec["model"] is None
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="job-entrypoint">train.py<' in page and "--lr 3e-4" in page
    assert f'title="{bundle}">bundle {bundle[7:19]}' in page
    assert ">Model<" not in page


def test_the_submit_form_shows_a_missing_script_and_stores_nothing(user, nodes, client, bundle):
    client.force_login(user)
    r = client.post("/jobs/new/", {"spec": yaml_text(entry_spec(bundle, entrypoint={"script": "gone.py"}))})
    assert r.status_code == 400
    assert "entrypoint.script" in r.content.decode() and "gone.py is not a file in bundle" in r.content.decode()
    assert Job.objects.count() == 0


def yaml_text(spec: dict) -> str:
    import yaml

    return yaml.safe_dump(spec)


def test_a_built_in_job_page_still_shows_its_model(user, nodes, client):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "b"}))
    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert ">Model<" in page and 'id="job-entrypoint"' not in page


# ---------------------------------------------------------------- hang detection

@pytest.fixture
def relay_alive(monkeypatch):

    monkeypatch.setattr(selectors, "relay_alive", lambda: True)


def test_a_script_that_never_reports_a_step_is_not_killed_as_hung(user, nodes, bundle, relay_alive, client_for):
    job = services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle)))
    attempt = start(job)
    Attempt.objects.filter(pk=attempt.pk).update(started_at=timezone.now() - timedelta(hours=3))
    assert services.attempts_check()["hung"] == []
    assert not JobEvent.objects.filter(kind="hang_detected").exists()
    health = client_for(user).get(f"/api/v1/jobs/{job.pk}/").json()["health"]
    assert health == {"last_progress_at": None, "hang_timeout_s": None, "hang_timeout_source": "auto: from the first step"}


def test_a_built_in_job_without_steps_is_still_killed_after_the_startup_grace(user, nodes, relay_alive):
    job = services.job_submit(user=user, spec=services.submitted_spec({"name": "b"}))
    attempt = start(job)
    Attempt.objects.filter(pk=attempt.pk).update(started_at=timezone.now() - timedelta(hours=3))
    assert services.attempts_check()["hung"] == [attempt.pk]


def test_user_code_that_reported_steps_is_judged_like_the_built_in_trainer(user, nodes, bundle, relay_alive):
    job = services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle)))
    attempt = start(job)
    Attempt.objects.filter(pk=attempt.pk).update(last_step=3, last_progress_at=timezone.now() - timedelta(hours=1))
    assert services.attempts_check()["hung"] == [attempt.pk]


def test_an_explicit_timeout_bounds_a_script_without_the_sdk(user, nodes, bundle, relay_alive):
    job = services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle, hang_timeout_s=600)))
    attempt = start(job)
    Attempt.objects.filter(pk=attempt.pk).update(started_at=timezone.now() - timedelta(hours=1))
    assert services.attempts_check()["hung"] == [attempt.pk]


def test_past_runs_of_the_same_code_predict_the_next(user, nodes, bundle):
    from jobs.planning import selectors as planning_selectors

    job = services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle)))
    attempt = start(job)
    now = timezone.now()
    Attempt.objects.filter(pk=attempt.pk).update(outcome="succeeded", started_at=now - timedelta(seconds=400),
                                                 ended_at=now, last_step=0)
    runs = planning_selectors.past_runs()
    assert len(runs) == 1 and runs[0].steps_run == 0 and runs[0].shape.bundle == bundle  # no SDK: no steps
    again = services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle)))
    assert again.predicted_s == pytest.approx(400.0, abs=1) and again.plan["prediction_source"] == "history:user"


def test_success_of_user_code_says_what_it_reported(user, nodes, bundle):
    from tests.jobs.runs.test_services import ok_result

    job = services.job_submit(user=user, spec=services.submitted_spec(entry_spec(bundle)))
    attempt = start(job)
    for n in ("node-a", "node-b"):
        services.attempt_node_exit(attempt.pk, node_name=n, result=ok_result(n, attempt.pk))
    assert Job.objects.get(pk=job.pk).status == "SUCCEEDED"
    assert JobEvent.objects.get(job=job, kind="succeeded").message == "the entrypoint exited 0 (it reported no steps)"


@pytest.mark.parametrize("depth", [33, 5000])
def test_a_deeply_nested_config_is_400_not_a_crash(user, nodes, client_for, depth):
    config = {}
    cur = config
    for _ in range(depth - 1):
        cur["a"] = {}
        cur = cur["a"]
    body = '{"name": "deep", "entrypoint": {"module": "pkg.train"}, "config": ' + _dumps(config) + "}"
    r = client_for(user).post("/api/v1/jobs/", body, content_type="application/json")
    assert r.status_code == 400, r.content[:300]
    assert Job.objects.count() == 0


def _dumps(config: dict) -> str:
    # iterative: json.dumps itself would recurse too deep for the deepest case
    depth, cur = 0, config
    while cur:
        depth, cur = depth + 1, cur["a"]
    return '{"a": ' * depth + "{}" + "}" * depth


def test_the_form_refuses_a_spec_nested_too_deeply(user, nodes, client):
    client.force_login(user)
    r = client.post("/jobs/new/", {"spec": "[" * 100000 + "]" * 100000})
    assert r.status_code == 400 and "nests too deeply" in r.content.decode()
    assert Job.objects.count() == 0
