"""The deployment files (issue 16, section 6): the `trainyard-agent` console script, the systemd
units of deploy/systemd/, the environment examples of deploy/env/ and the commands of
docs/deploy.md are checked against what the project really has (no processes; the
systemd-analyze, packaging and Redis ACL checks that start processes are in
tests/integration/test_deploy_procs.py).

A guide command whose interface another part of issue 16 is still adding is listed in PENDING:
it must be marked "(may still change)" in the guide, and it is checked like any other as soon as
the project has it."""
from __future__ import annotations

import argparse
import configparser
import importlib
import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "deploy" / "systemd"
ENV_EXAMPLES = REPO / "deploy" / "env"
GUIDE = REPO / "docs" / "deploy.md"
PREFIX = "/opt/trainyard"  # where the units expect the repository (docs/deploy.md)
UNIT_NAMES = ["trainyard-web.service", "trainyard-control.service", "trainyard-beat.service",
              "trainyard-relay.service", "trainyard-agent@.service", "trainyard-notify.service"]
# management commands and agent options the guide uses before their part of issue 16 has landed
PENDING_COMMANDS: set[str] = set()  # node_add exists now
PENDING_AGENT_OPTIONS: set[str] = set()  # --credential-file exists now
SHELL_STOP = {"|", "||", "&&", ";", ">", ">>", "<", "2>&1", "&"}


def unit(name: str) -> configparser.ConfigParser:
    """A unit file as sections of keys; a key given twice keeps every value (newline-joined)."""
    class Multi(dict):
        def __setitem__(self, key, value):
            if key in self and isinstance(value, list):
                self[key].extend(value)
            else:
                super().__setitem__(key, value)

    cp = configparser.RawConfigParser(strict=False, dict_type=Multi, empty_lines_in_values=False,
                                      comment_prefixes=("#", ";"), interpolation=None)
    cp.optionxform = str  # keys are case-sensitive
    cp.read_string((UNITS / name).read_text())
    return cp


def values(cp: configparser.ConfigParser, section: str, key: str) -> list[str]:
    raw = cp[section].get(key) if cp.has_section(section) else None
    return [] if raw is None else [v.strip() for v in raw.split("\n") if v.strip()]


def env_example(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, _, value = line.partition("=")
        out[name] = value[1:-1] if value.startswith("'") and value.endswith("'") else value
    return out


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^[ \t]*```[a-z]*\n(.*?)^[ \t]*```", text, flags=re.S | re.M)


def guide_lines() -> list[str]:
    """Every command line of the guide's code blocks, continuation lines joined."""
    lines = []
    for block in fenced_blocks(GUIDE.read_text()):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split("  #", 1)[0].strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def words_after(line: str, marker: re.Pattern) -> list[str] | None:
    """The arguments after the program `marker` matches, up to a shell operator."""
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    for i, w in enumerate(words):
        if marker.search(w):
            rest = []
            for arg in words[i + 1:]:
                if arg in SHELL_STOP:
                    break
                rest.append(arg)
            return rest
    return None


# ---------------------------------------------------------------- the console script

def declared_scripts() -> dict[str, str]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_trainyard_agent_entry_point_is_the_modules_main():
    """`trainyard-agent` runs the same function as `python -m workers.agent` (whose __main__
    block calls workers.agent.main)."""
    target = declared_scripts().get("trainyard-agent")
    assert target == "workers.agent:main", target
    module, _, attr = target.partition(":")
    from workers import agent

    assert getattr(importlib.import_module(module), attr) is agent.main
    assert "_agent.main()" in (REPO / "workers" / "agent.py").read_text().split('if __name__ == "__main__":')[1]


def test_the_installed_package_contains_what_every_console_script_imports():
    """`make venv` installs the package (pip install -e .) with only the packages pyproject's
    packages.find includes; a console script whose module is left out fails outside the repo."""
    from setuptools import find_namespace_packages

    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = set(find_namespace_packages(where=str(REPO), include=cfg["include"]))
    for name, target in declared_scripts().items():
        module = target.partition(":")[0]
        missing = [p for p in _parents(module) if p not in packages]
        assert not missing, f"console script {name} imports {module}, but {missing} are not installed"
    assert {"workers", "workers.runtime"} <= packages


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))] or [module]


# ---------------------------------------------------------------- the units

# What the agent's job sandbox needs (workers/sandbox.py; the unit says why for each).
AGENT_CAPS = {"CAP_SYS_ADMIN", "CAP_SYS_CHROOT", "CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP", "CAP_CHOWN",
              "CAP_FOWNER", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_KILL", "CAP_SYS_PTRACE",
              "CAP_SYS_RESOURCE"}

@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_has_the_required_sections_and_hardening(name):
    cp = unit(name)
    assert values(cp, "Unit", "Description"), name
    assert values(cp, "Install", "WantedBy") == ["multi-user.target"], name
    svc = {k: values(cp, "Service", k) for k in cp["Service"]}
    required = {"User": ["trainyard"], "Group": ["trainyard"], "NoNewPrivileges": ["yes"],
                "ProtectSystem": ["strict"], "ProtectHome": ["yes"], "PrivateTmp": ["yes"],
                "Restart": ["on-failure"], "UMask": ["0077"]}
    if name.startswith("trainyard-agent"):  # root with a bounded capability set: it makes the job sandboxes
        required.update({"User": ["root"], "Group": ["root"]})
        caps = set(" ".join(svc.get("CapabilityBoundingSet", [])).split())
        assert caps == AGENT_CAPS, f"{name}: CapabilityBoundingSet={sorted(caps)}"
        for key in ("ProtectKernelTunables", "ProtectControlGroups", "PrivateDevices"):
            assert key not in svc, f"{name}: {key} stops bwrap from mounting the sandbox's /proc or GPUs"
    for key, want in required.items():
        assert svc.get(key) == want, f"{name}: {key}={svc.get(key)}, want {want}"
    assert float(svc["RestartSec"][0]) >= 1, f"{name}: restarts need a backoff (RestartSec)"
    assert int(values(cp, "Unit", "StartLimitBurst")[0]) >= 3, name
    assert len(svc["ExecStart"]) == 1, name
    envfiles = svc.get("EnvironmentFile", [])
    assert envfiles and all(re.fullmatch(r"/etc/trainyard/[\w%@.-]+\.env", f) for f in envfiles), (name, envfiles)
    rw = " ".join(svc.get("ReadWritePaths", [])).split()
    assert "/var/lib/trainyard" in rw, f"{name}: TRAINYARD_VAR_DIR must be writable"


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_can_write_the_roots_its_environment_names(name):
    """ProtectSystem=strict makes everything else read-only: the checkpoint and artifact roots of
    the unit's environment (the examples) must lie under a ReadWritePaths entry."""
    cp = unit(name)
    env = {}
    for f in values(cp, "Service", "EnvironmentFile"):
        env.update(env_example(example_for(f)))
    writable = " ".join(values(cp, "Service", "ReadWritePaths")).split()
    needs = ["TRAINYARD_VAR_DIR"] if name == "trainyard-beat.service" else [
        "TRAINYARD_VAR_DIR", "TRAINYARD_CHECKPOINT_ROOT", "TRAINYARD_ARTIFACT_ROOT"]
    if name.startswith("trainyard-agent"):
        needs.append("TRAINYARD_RUN_DIR")
    for var in needs:
        path = env[var]
        assert any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable), (name, var, path, writable)


def example_for(envfile: str) -> Path:
    """/etc/trainyard/control.env -> deploy/env/control.env.example (agent-%i -> agent-gpu-1)."""
    return ENV_EXAMPLES / (Path(envfile.replace("%i", "gpu-1")).name + ".example")


def exec_argv(name: str, env: dict[str, str] | None = None) -> list[str]:
    cp = unit(name)
    line = values(cp, "Service", "ExecStart")[0].replace("%%", "%").replace("%i", "gpu-1")
    for var, value in (env or {}).items():
        line = line.replace("${%s}" % var, shlex.quote(value))
    return shlex.split(line)


def test_every_unit_starts_a_program_the_project_installs():
    scripts = declared_scripts()
    for name in UNIT_NAMES:
        argv = exec_argv(name)
        assert argv[0].startswith(f"{PREFIX}/.venv/bin/"), (name, argv[0])
        program = argv[0].rsplit("/", 1)[1]
        assert program in scripts or (REPO / ".venv" / "bin" / program).exists(), (name, program)
        wd = values(unit(name), "Service", "WorkingDirectory")
        if "manage.py" in argv or any(a.startswith("controlplane") for a in argv):
            assert wd == [PREFIX], f"{name} imports the Django project: WorkingDirectory={PREFIX}"


def test_web_unit_runs_daphne_on_loopback_with_the_asgi_application():
    from daphne.cli import CommandLineInterface

    from controlplane import serve

    argv = exec_argv("trainyard-web.service")
    assert argv[1:3] == ["-m", "controlplane.serve"], argv
    launcher, daphne_args = serve.parse(argv[3:])
    assert launcher.bind == "127.0.0.1", launcher  # behind the TLS proxy only
    # what each worker runs: daphne's own parser must accept it, with the proxy headers on
    worker = serve.Launcher(launcher, daphne_args, sock=type("S", (), {"fileno": lambda self: 3})()).command()
    args = CommandLineInterface().parser.parse_args(worker[3:])
    assert args.file_descriptor == 3 and args.proxy_headers, args
    module, _, attr = args.application.partition(":")
    assert importlib.util.find_spec(module) is not None
    assert re.search(rf"^{attr}\s*=", (REPO / (module.replace(".", "/") + ".py")).read_text(), re.M)


def procfile() -> dict[str, list[str]]:
    out = {}
    for line in (REPO / "Procfile").read_text().splitlines():
        name, _, cmd = line.partition(":")
        out[name.strip()] = shlex.split(cmd)
    return out


@pytest.mark.parametrize("name,proc", [("trainyard-control.service", "control"),
                                       ("trainyard-beat.service", "beat"), ("trainyard-notify.service", "notify")])
def test_celery_units_run_what_make_run_runs(name, proc):
    """The control worker and beat run with the same arguments as under `make run` (Procfile),
    which the integration tests start; only the schedule file's place differs."""
    unit_args, run_args = exec_argv(name)[1:], procfile()[proc][1:]
    assert importlib.util.find_spec("controlplane.celery") is not None
    if proc == "beat":
        assert unit_args[unit_args.index("-s") + 1].startswith("/var/lib/trainyard/")
        unit_args = unit_args[:unit_args.index("-s")]
        run_args = run_args[:run_args.index("-s")]
    assert unit_args == run_args


def test_relay_unit_runs_the_relay_command():
    from django.core.management import get_commands

    argv = exec_argv("trainyard-relay.service")
    assert argv[1:] == ["manage.py", "relay"] and "relay" in get_commands()


class _Parsed(Exception):
    pass


def parse_agent_args(args: list[str], monkeypatch) -> argparse.Namespace:
    """The agent's own argument parser (workers.agent.main), stopped right after parsing."""
    from workers import agent

    def stop(*_a, **_k):
        raise _Parsed()

    captured = {}
    real = argparse.ArgumentParser.parse_args

    def capture(self, argv=None, namespace=None):
        captured["ns"] = real(self, argv, namespace)
        return captured["ns"]

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr(agent, "start_gpu_monitor", stop)
        m.setattr(agent, "load_credential", lambda path, name: "credential-checked-in-its-own-test")
        m.setattr(agent.logging, "basicConfig", lambda **_: None)
        with pytest.raises(_Parsed):
            agent.main(args)
    return captured["ns"]


def agent_args_known(args: list[str], monkeypatch, where: str) -> argparse.Namespace:
    """Parse `args` with the agent's parser; an option in PENDING_AGENT_OPTIONS that this version
    does not have yet is dropped (with its value) and the rest must still parse."""
    from workers import agent

    help_text = _agent_help(agent)
    kept, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in PENDING_AGENT_OPTIONS and a not in help_text:
            skip = True
            continue
        kept.append(a)
    try:
        return parse_agent_args(kept, monkeypatch)
    except SystemExit as exc:
        pytest.fail(f"{where}: the agent refuses {args}: exit {exc.code}")


def _agent_help(agent) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        agent.main(["--help"])
    return out.getvalue()


def test_agent_unit_arguments_parse_with_the_example_environment(monkeypatch):
    """The agent's ExecStart, with the variables of its environment examples substituted, is a
    command line the agent accepts: every ${VAR} it uses is set by an example."""
    cp = unit("trainyard-agent@.service")
    env = {}
    for f in values(cp, "Service", "EnvironmentFile"):
        env.update(env_example(example_for(f)))
    argv = exec_argv("trainyard-agent@.service", env)
    assert not [a for a in argv if "${" in a], f"variables no example sets: {argv}"
    assert argv[0] == f"{PREFIX}/.venv/bin/trainyard-agent"
    ns = agent_args_known(argv[1:], monkeypatch, "trainyard-agent@.service")
    assert ns.name == "gpu-1" and ns.device == "cuda" and ns.slots == int(env["AGENT_SLOTS"])
    assert values(cp, "Service", "KillMode") == ["process"]  # a crashed agent's ranks keep running
    assert values(cp, "Service", "PrivateDevices") == []  # the GPUs stay visible


def test_every_environment_file_is_documented_and_has_an_example():
    guide = GUIDE.read_text()
    for name in UNIT_NAMES:
        for f in values(unit(name), "Service", "EnvironmentFile"):
            assert f in guide, f"{name}: {f} is not in docs/deploy.md"
            assert example_for(f).exists(), f"{name}: no example {example_for(f)}"


SETTING = re.compile(r'"((?:TRAINYARD|DJANGO)_[A-Z0-9_]+|DATABASE_URL|REDIS_URL)"')
NOT_DEPLOYMENT = {"DJANGO_SETTINGS_MODULE": "set by the code", "TRAINYARD_TEST_DB": "tests only"}


def read_settings() -> set[str]:
    """Every environment variable the control plane and the node agents read."""
    files = [*(REPO / "controlplane").glob("*.py"), *(REPO / "jobs").rglob("*.py"),
             REPO / "trainyard" / "keys.py", REPO / "trainyard" / "bundle.py",
             REPO / "workers" / "agent.py", REPO / "workers" / "celery_app.py"]
    names = set()
    for f in files:
        if "migrations" not in f.parts:
            names |= set(SETTING.findall(f.read_text()))
    return names - set(NOT_DEPLOYMENT)


def test_the_guide_covers_every_setting_the_services_read():
    names = read_settings()
    assert {"TRAINYARD_TLS", "DJANGO_ALLOWED_HOSTS", "TRAINYARD_WS_ORIGINS", "DJANGO_SECRET_KEY",
            "TRAINYARD_THROTTLE_ANON", "TRAINYARD_CHECKPOINT_ROOT"} <= names  # the scan finds them
    guide = GUIDE.read_text()
    missing = sorted(n for n in names if n not in guide)
    assert not missing, f"docs/deploy.md does not say what to do with {missing}"


def test_environment_examples_set_only_real_settings_and_source_in_sh():
    """Every variable of an example is one the project (or the agent unit, or NCCL) reads, and
    each line is NAME=value that `set -a; . file` in sh and systemd read alike (values with
    shell characters single-quoted)."""
    known = read_settings() | {"AGENT_ADDRESS", "AGENT_SLOTS", "AGENT_DEVICE", "AGENT_LABELS"}
    for path in sorted(ENV_EXAMPLES.glob("*.env.example")):
        for line in path.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*=('[^']*'|[^\s'\"<>&|;()$`\\]*)", line), f"{path.name}: {line}"
            name = line.split("=", 1)[0]
            assert name in known or name.startswith("NCCL_"), f"{path.name}: {name} is read by nothing"
    control = env_example(ENV_EXAMPLES / "control.env.example")
    assert control["TRAINYARD_TLS"] == "1" and control["DJANGO_DEBUG"] == "0"
    assert control["TRAINYARD_WS_ORIGINS"] == control["DJANGO_CSRF_TRUSTED_ORIGINS"].split(",")[0]
    agent = env_example(ENV_EXAMPLES / "agent.env.example")
    for root in ("TRAINYARD_CHECKPOINT_ROOT", "TRAINYARD_ARTIFACT_ROOT", "TRAINYARD_DATA_ROOT"):
        assert agent[root] == control[root], f"{root}: one shared path on every host"


# ---------------------------------------------------------------- the guide's commands

MANAGE = re.compile(r"(^|/)(manage\.py|trainyard-manage)$")
AGENT = re.compile(r"(^|/)trainyard-agent$")


def manage_invocations() -> list[tuple[str, list[str]]]:
    out = []
    for line in guide_lines():
        args = words_after(line, MANAGE)
        if args and re.fullmatch(r"[a-z_]+", args[0]):
            out.append((line, args))
    return out


def test_the_guides_manage_commands_exist_with_their_options():
    from django.core.management import get_commands, load_command_class

    commands = get_commands()
    found = manage_invocations()
    assert {a[0] for _, a in found} >= {"migrate", "collectstatic", "ensure_admin", "node_add", "check"}
    guide = GUIDE.read_text()
    for line, args in found:
        name = args[0]
        if name not in commands:
            assert name in PENDING_COMMANDS, f"docs/deploy.md runs `manage.py {name}`, which does not exist: {line}"
            assert re.search(rf"{name}.{{0,400}}may still change|may still change.{{0,400}}{name}", guide, re.S), \
                f"{name} is not there yet: the guide must mark it (may still change)"
            continue
        parser = load_command_class(commands[name], name).create_parser("manage.py", name)
        try:
            parser.parse_args(args[1:])
        except (SystemExit, Exception) as exc:  # CommandParser raises CommandError outside the CLI
            pytest.fail(f"docs/deploy.md: `manage.py {' '.join(args)}` is refused by {name}: {exc!r}")


def test_the_guides_agent_commands_parse(monkeypatch):
    lines = [(line, words_after(line, AGENT)) for line in guide_lines()]
    lines = [(line, args) for line, args in lines if args is not None]
    assert lines, "docs/deploy.md shows no trainyard-agent command line"
    for line, args in lines:
        ns = agent_args_known(args, monkeypatch, line)
        assert ns.name and ns.address and ns.slots >= 1


def test_the_guides_units_and_paths_exist():
    """Every unit the guide starts is one of deploy/systemd/, every deploy/ file it installs
    exists, and every API path it calls resolves."""
    from django.urls import Resolver404, resolve

    text = "\n".join(guide_lines())
    for u in re.findall(r"\b(trainyard-[a-z]+)(?:@[\w*'-]+)?(?:\.service)?\b", text):
        if u == "trainyard-manage":  # the guide's wrapper script, not a unit
            continue
        assert (UNITS / f"{u}.service").exists() or (UNITS / f"{u}@.service").exists(), u
    for path in re.findall(r"\b(deploy/[\w./*-]+)", text):
        assert list(REPO.glob(path)), f"docs/deploy.md installs {path}, which does not exist"
    for path in re.findall(r"https?://[^/\s]+(/api/v1/[\w/-]+)", text):
        try:
            resolve(path)
        except Resolver404:
            pytest.fail(f"docs/deploy.md calls {path}, which no URL serves")
