"""What a node checks and unpacks before it launches user code (a JobSpec `entrypoint`).

The agent calls `prepare(spec, run_dir, node=...)` after the rendezvous port is settled and before
the launcher starts torchrun. It returns the LaunchRequest fields of a user-code launch (none for
the built-in trainer) or raises `UserCodeError`, whose message is the failure the node reports:
it starts with `EntrypointError:` or `BundleError:`, which jobs.attempts.policy.diagnosis classes as
`user_error` (no retry: the same job on another node would fail the same way).

- `python`: must be an absolute path to an executable file on this node, inside a read-only path
  of the job sandbox (/usr, the agent's own environment, the operator's TRAINYARD_SANDBOX_RO; never
  a directory a job can write: an earlier job could have left a program there), that can run
  torchrun (`import torch.distributed.run`). The path is checked here (stat only); the import is
  tried in the attempt's own sandbox (`check_python_runs`, called by the agent), never as the
  agent, so that a typo fails the attempt in seconds with that message instead of as an
  unexplained torchrun exit.
- `code.bundle`: the content-addressed file under the artifact root (`keys.bundle_path`), shared
  by the control plane and every node like the checkpoint root; `trainyard.bundle.extract_bundle`
  re-verifies its sha256 and every member and unpacks it read-only into `<run_dir>/code/`.
- `entrypoint.script`: a file in the bundle; without a bundle, an absolute path on the node.
  A module is looked up by Python itself: the bundle first on PYTHONPATH, then the node's.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from trainyard import keys, safefs
from trainyard.bundle import BundleError, BundleLimits, extract_bundle, open_stored, remove_tree

PROBE_TIMEOUT_S = 60.0  # importing torch in a cold interpreter on a loaded 2-core node
CODE_DIR = "code"


class UserCodeError(Exception):
    """This node cannot start the job's code; the message is the attempt's failure message."""


def prepare(spec: dict[str, Any], run_dir: Path, *, node: str,
            ro_roots: tuple[str, ...] | None = None) -> dict[str, Any]:
    """LaunchRequest fields for the job's entrypoint; {} for a built-in (model/data) job.
    `ro_roots`: the sandbox's read-only paths the job's `python` must be under (None: no sandbox)."""
    entry = spec.get("entrypoint")
    if not entry:
        return {}
    python = spec.get("python") or ""
    if python:
        check_python(python, node=node, ro_roots=ro_roots)
    digest = (spec.get("code") or {}).get("bundle")
    code_dir = str(unpack(digest, Path(run_dir), node=node)) if digest else ""
    fields: dict[str, Any] = {
        "user_code": True, "python": python, "code_dir": code_dir,
        "args": tuple(str(a) for a in entry.get("args") or ()),
        "env": {str(k): str(v) for k, v in (spec.get("env") or {}).items()},
    }
    if entry.get("script"):
        fields["script"] = find_script(entry["script"], code_dir, node=node, ro_roots=ro_roots)
    else:
        fields["module"] = entry["module"]
    return fields


def check_python(python: str, *, node: str, ro_roots: tuple[str, ...] | None = None) -> None:
    """The static checks of the job's `python` (nothing is run here)."""
    if not os.path.isabs(python):
        raise UserCodeError(f"EntrypointError: python {python!r} is not an absolute path")
    if ro_roots is not None:
        inside = [p for p in (os.path.normpath(python), os.path.realpath(python))
                  if not any(safefs.is_inside(p, root) for root in ro_roots)]
        if inside:
            raise UserCodeError(
                f"EntrypointError: python {python!r} is not in a read-only path of the job sandbox on node "
                f"{node} ({', '.join(ro_roots)}): the node's operator can add its environment to TRAINYARD_SANDBOX_RO")
    if not os.path.isfile(python):
        raise UserCodeError(f"EntrypointError: python {python!r} does not exist on node {node}")
    if not os.access(python, os.X_OK):
        raise UserCodeError(f"EntrypointError: python {python!r} is not executable on node {node}")


def check_python_runs(python: str, *, node: str,
                      run: Callable[[list[str], float], tuple[int, str]] | None = None) -> None:
    """That the job's `python` imports torchrun: run by `run(argv, timeout_s)` -> (exit code, stderr)
    (the attempt's sandbox, workers/sandbox.py), or as a plain subprocess without a sandbox."""
    if not python or os.path.realpath(python) == os.path.realpath(sys.executable):
        return  # the agent's own interpreter runs torchrun already
    argv = [python, "-c", "import torch.distributed.run"]
    try:
        if run is not None:
            code, stderr = run(argv, PROBE_TIMEOUT_S)
        else:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
            code, stderr = done.returncode, done.stderr
    except OSError as exc:  # not an executable format, for one
        raise UserCodeError(f"EntrypointError: python {python!r} cannot be run on node {node}: {exc}") from None
    except subprocess.TimeoutExpired:
        raise UserCodeError(f"EntrypointError: python {python!r} on node {node} did not import torch "
                            f"within {PROBE_TIMEOUT_S:.0f} s") from None
    probe = subprocess.CompletedProcess(argv, code, "", stderr)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
        raise UserCodeError(f"EntrypointError: python {python!r} on node {node} cannot run "
                            f"torch.distributed.run: {last}")


def unpack(digest: str, run_dir: Path, *, node: str) -> Path:
    """Verify and extract the bundle into <run_dir>/code (read-only); its path."""
    path = keys.bundle_path(keys.artifact_root(), digest)
    try:  # no symlink below the artifact root is followed, and only a regular file is read
        fd = open_stored(keys.artifact_root(), digest)
    except FileNotFoundError:
        raise UserCodeError(f"BundleError: code bundle {digest} is not at {path} on node {node} (the "
                            "artifact root must be shared by the control plane and every node)") from None
    except OSError as exc:  # safefs.UnsafePath: a link or another kind of file in its place
        raise UserCodeError(f"BundleError: code bundle {digest} at {path} on node {node} is refused: {exc}") from None
    dest = run_dir / CODE_DIR
    try:
        if dest.exists():  # an earlier delivery of this launch got this far: start from scratch
            remove_tree(dest)
        extract_bundle(fd, dest, digest=digest, limits=BundleLimits.from_env())
    except BundleError as exc:
        raise UserCodeError(f"BundleError: code bundle {digest} on node {node}: {exc}") from None
    finally:
        os.close(fd)
    return dest


def find_script(script: str, code_dir: str, *, node: str, ro_roots: tuple[str, ...] | None = None) -> str:
    """The script's absolute path: inside the bundle, or (no bundle; the spec requires it) absolute."""
    if code_dir:
        path = os.path.normpath(os.path.join(code_dir, script))
        if os.path.commonpath([path, code_dir]) == code_dir and os.path.isfile(path):
            return path
        raise UserCodeError(f"EntrypointError: entrypoint.script {script!r} is not a file of the code bundle")
    if ro_roots is not None and not any(safefs.is_inside(script, root) for root in ro_roots):
        raise UserCodeError(f"EntrypointError: entrypoint.script {script!r} is not in a read-only path of the job "
                            f"sandbox on node {node} ({', '.join(ro_roots)}): upload it as a code bundle, or "
                            f"the node's operator can add its directory to TRAINYARD_SANDBOX_RO")
    if os.path.isabs(script) and os.path.isfile(script):
        return script
    raise UserCodeError(f"EntrypointError: entrypoint.script {script!r} does not exist on node {node}")
