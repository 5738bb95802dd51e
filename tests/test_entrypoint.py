"""workers.entrypoint: what a node checks and unpacks before it launches user code, and how its
refusals read to the control plane's diagnosis (user_error, no retry)."""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from jobs.attempts.policy.diagnosis import diagnose
from trainyard import keys
from workers.entrypoint import check_python_runs, UserCodeError, prepare

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def pack_dir(src: Path) -> bytes:
    """A .tar.gz of src's files, paths relative to src: what `trainyard submit --code` uploads."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(src.rglob("*")):
            if "__pycache__" not in path.parts:
                tar.add(path, arcname=str(path.relative_to(src)), recursive=False)
    return buf.getvalue()


def store(root: Path, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    path = keys.bundle_path(root, digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


@pytest.fixture
def artifacts(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "artifacts"
    monkeypatch.setenv("TRAINYARD_ARTIFACT_ROOT", str(root))
    return root


def user_spec(**extra) -> dict:
    return {"name": "u", "entrypoint": {"script": "train.py", "args": ["--steps", "3"]}, **extra}


def failure_class(message: str) -> tuple[str, bool, str]:
    d = diagnose([{"node": "node-a", "exit_code": None, "failures": [{"message": message, "timestamp": 1.0}]}])
    return d.failure_class, d.retry, d.message


def test_builtin_jobs_need_nothing(tmp_path):
    assert prepare({"name": "gpt", "model": {"kind": "gpt"}, "entrypoint": None}, tmp_path, node="n") == {}


def test_the_bundle_is_verified_and_unpacked_read_only_into_the_run_dir(tmp_path, artifacts):
    digest = store(artifacts, pack_dir(EXAMPLES / "plain"))
    run_dir = tmp_path / "attempt-1"
    fields = prepare(user_spec(code={"bundle": digest}, env={"HF_HOME": "/data/hf"}), run_dir, node="n")
    code = run_dir / "code"
    assert fields == {"user_code": True, "python": "", "code_dir": str(code), "script": str(code / "train.py"),
                      "args": ("--steps", "3"), "env": {"HF_HOME": "/data/hf"}}
    assert (code / "train.py").read_bytes() == (EXAMPLES / "plain" / "train.py").read_bytes()
    assert not code.stat().st_mode & stat.S_IWUSR and not (code / "train.py").stat().st_mode & stat.S_IWUSR
    # a second delivery of the same launch starts again from a clean copy
    assert prepare(user_spec(code={"bundle": digest}), run_dir, node="n")["code_dir"] == str(code)
    module = prepare({"name": "m", "code": {"bundle": digest}, "entrypoint": {"module": "train"}}, tmp_path / "a2",
                     node="n")
    assert module["module"] == "train" and "script" not in module and module["args"] == ()


def test_a_missing_bundle_fails_with_where_it_looked(tmp_path, artifacts):
    digest = "sha256:" + "ab" * 32
    with pytest.raises(UserCodeError) as exc:
        prepare(user_spec(code={"bundle": digest}), tmp_path, node="node-b")
    msg = str(exc.value)
    assert msg.startswith("BundleError: ") and digest in msg and "node-b" in msg
    assert str(keys.bundle_path(artifacts, digest)) in msg
    assert failure_class(msg)[:2] == ("user_error", False)


def test_a_corrupt_bundle_is_refused_and_nothing_is_unpacked(tmp_path, artifacts):
    data = pack_dir(EXAMPLES / "plain")
    digest = store(artifacts, data)
    keys.bundle_path(artifacts, digest).write_bytes(pack_dir(EXAMPLES / "sdk_ddp"))  # replaced on disk
    with pytest.raises(UserCodeError) as exc:
        prepare(user_spec(code={"bundle": digest}), tmp_path / "run", node="n")
    assert str(exc.value).startswith("BundleError: ") and "expected" in str(exc.value)
    assert not (tmp_path / "run" / "code").exists()
    assert failure_class(str(exc.value))[:2] == ("user_error", False)


def test_a_script_missing_from_the_bundle_or_the_node(tmp_path, artifacts):
    digest = store(artifacts, pack_dir(EXAMPLES / "plain"))
    spec = user_spec(code={"bundle": digest}, entrypoint={"script": "nope.py"})
    with pytest.raises(UserCodeError, match="EntrypointError: entrypoint.script 'nope.py' is not a file"):
        prepare(spec, tmp_path / "r1", node="n")
    with pytest.raises(UserCodeError, match="'/nowhere/train.py' does not exist on node n"):
        prepare(user_spec(entrypoint={"script": "/nowhere/train.py"}), tmp_path / "r2", node="n")
    script = str(EXAMPLES / "plain" / "train.py")  # no bundle: an absolute path on the node
    assert prepare(user_spec(entrypoint={"script": script}), tmp_path / "r3", node="n")["script"] == script


def test_a_python_that_does_not_exist_or_cannot_run_is_a_user_error(tmp_path):
    with pytest.raises(UserCodeError) as exc:
        prepare(user_spec(python="/opt/nowhere/bin/python"), tmp_path, node="node-a")
    assert str(exc.value) == "EntrypointError: python '/opt/nowhere/bin/python' does not exist on node node-a"
    assert failure_class(str(exc.value)) == ("user_error", False, str(exc.value))
    not_exec = tmp_path / "python"
    not_exec.write_text("#!/bin/sh\n")
    with pytest.raises(UserCodeError, match="is not executable on node node-a"):
        prepare(user_spec(python=str(not_exec)), tmp_path, node="node-a")
    fields = prepare(user_spec(entrypoint={"script": str(EXAMPLES / "plain" / "train.py")}, python=sys.executable),
                     tmp_path, node="node-a")  # the agent's own interpreter: no probe needed
    assert fields["python"] == sys.executable


def test_under_a_sandbox_the_jobs_python_and_script_must_be_in_its_read_only_paths(tmp_path):
    """Issue 21 s1: a `python` or a bundle-less script elsewhere (a directory an earlier job could
    write, the agent's state) is refused without being run or even looked at."""
    ro = ("/usr", str(EXAMPLES))
    planted = tmp_path / "agents" / "node-a" / "attempt-3" / "tmp" / "python"
    planted.parent.mkdir(parents=True)
    planted.write_text("#!/bin/sh\n")
    planted.chmod(0o755)
    for python in (str(planted), "/opt/envs/nlp/bin/python", "/usr/../tmp/python"):
        with pytest.raises(UserCodeError, match="is not in a read-only path of the job sandbox on node n") as exc:
            prepare(user_spec(python=python, entrypoint={"script": str(EXAMPLES / "plain" / "train.py")}),
                    tmp_path / "r", node="n", ro_roots=ro)
        assert failure_class(str(exc.value))[:2] == ("user_error", False)
    with pytest.raises(UserCodeError, match="entrypoint.script '/srv/x/train.py' is not in a read-only path"):
        prepare(user_spec(entrypoint={"script": "/srv/x/train.py"}), tmp_path / "r", node="n", ro_roots=ro)
    with pytest.raises(UserCodeError, match="does not exist on node n"):  # inside: the usual checks follow
        prepare(user_spec(python="/usr/nowhere/bin/python"), tmp_path / "r", node="n", ro_roots=ro)
    script = str(EXAMPLES / "plain" / "train.py")
    assert prepare(user_spec(entrypoint={"script": script}), tmp_path / "r", node="n", ro_roots=ro)["script"] == script


@pytest.mark.procs
def test_a_python_without_torch_fails_before_torchrun_with_its_error(tmp_path):
    other = shutil.which("python3", path="/usr/bin:/bin")
    if other is None or os.path.realpath(other) == os.path.realpath(sys.executable):
        pytest.skip("no second interpreter on this machine")
    prepare(user_spec(python=other, entrypoint={"script": str(EXAMPLES / "plain" / "train.py")}), tmp_path,
            node="node-a")  # the static checks pass; running it is the agent's, in the sandbox
    with pytest.raises(UserCodeError) as exc:
        check_python_runs(other, node="node-a")
    assert "cannot run torch.distributed.run: ModuleNotFoundError: No module named 'torch'" in str(exc.value)
    assert failure_class(str(exc.value))[:2] == ("user_error", False)


@pytest.mark.parametrize("name", ["sdk_ddp", "plain", "own_model", "own_model/job-tp.yaml",
                                  "own_model/job-balance.yaml"])
def test_the_examples_job_files_are_valid_entrypoint_specs(name):
    import yaml

    from trainyard.spec import parse_job_spec

    name, _, job = name.partition("/")
    data = yaml.safe_load((EXAMPLES / name / (job or "job.yaml")).read_text())
    data["code"] = {"bundle": "sha256:" + "0" * 64}  # what `trainyard submit --code` adds
    spec = parse_job_spec(data)
    assert spec.user_code and spec.model is None and (EXAMPLES / name / spec.entrypoint.script).is_file()
