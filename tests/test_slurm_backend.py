"""trainyard.slurm: the Slurm launch backend against a fake runner (argv recorded, answers
scripted), its pure parsers, and its runners (the local one for real against stand-in scripts, the
SSH one by its argv). No Slurm, no Django."""
from __future__ import annotations

import os
import shlex
import stat
import time

import pytest
from pydantic import ValidationError

from trainyard import backends
from trainyard.backends import BackendError, Gang, Handle, State, SubmitRefused
from trainyard.slurm import SlurmBackend, SlurmSettings, settings_errors
from trainyard.slurm_parse import (expand_hostlist, format_time_limit, parse_exit_code, parse_parsable,
                                   parse_start, pending_category, to_status)
from trainyard.slurm_runners import LocalRunner, SshRunner, build_runner
from trainyard.slurm_script import batch_script


class FakeRunner:
    """Answers each program (argv[0]) from its own queue of (rc, stdout, stderr) or exceptions;
    (0, "", "") once a queue is empty (sbatch: job 900)."""

    def __init__(self, **answers):
        self.answers = {k: list(v) for k, v in answers.items()}
        self.calls: list[list[str]] = []
        self.files: dict[str, str] = {}

    def run(self, argv, *, timeout, input=None):
        assert timeout > 0
        self.calls.append(list(argv))
        queue = self.answers.get(argv[0], [])
        answer = queue.pop(0) if queue else (0, "900\n" if argv[0] == "sbatch" else "", "")
        if isinstance(answer, Exception):
            raise answer
        return answer

    def write_private(self, path, data, *, timeout=30.0):
        self.files[path] = data

    def programs(self):
        return [c[0] for c in self.calls]


def settings(**kw):
    return SlurmSettings.model_validate({"state_dir": "/shared/ty", **kw})


def backend(runner=None, **kw):
    return SlurmBackend("gpu", settings(**kw), runner or FakeRunner())


def gang(**kw):
    base = dict(job_id=7, attempt_id=2, nodes=2, procs_per_node=4, command=("python", "-m", "workers.agent"))
    return Gang(**{**base, **kw})


H = Handle("slurm:gpu", "101")

# -- settings ----------------------------------------------------------------------------------


def test_settings_defaults_and_round_trip():
    s = settings(priority_map=[{"min_priority": 10, "qos": "high", "nice": 0}, {"min_priority": 0, "partition": "lo"}])
    assert (s.login, s.ssh_port, s.gres, s.command_timeout_s) == ("", 22, "gpu", 30.0)
    assert (s.preempt_signal, s.checkpoint_signal, s.extra_args) == ("TERM", "USR1", ())
    assert SlurmSettings.model_validate(s.model_dump(mode="json")) == s
    assert settings_errors(s.model_dump(mode="json")) == {}


@pytest.mark.parametrize("data, path, words", [
    ({}, "state_dir", "Field required"),
    ({"state_dir": "relative"}, "state_dir", "absolute path"),
    ({"state_dir": "/a/../b"}, "state_dir", "normalised"),
    ({"state_dir": "/a b"}, "state_dir", "no spaces"),
    ({"state_dir": "/out%j"}, "state_dir", "%"),
    ({"state_dir": "/"}, "state_dir", "below /"),
    ({"login": "-oProxyCommand=x"}, "login", "user@host"),
    ({"login": "me@login1"}, "ssh_key", "required when login is set"),
    ({"login": "login1", "ssh_key": "key"}, "ssh_key", "absolute path"),
    ({"ssh_port": 0}, "ssh_port", "greater than or equal to 1"),
    ({"ssh_port": 70000}, "ssh_port", "less than or equal to 65535"),
    ({"known_hosts": "kh"}, "known_hosts", "absolute path"),
    ({"slurm_conf": "etc/slurm.conf"}, "slurm_conf", "absolute path"),
    ({"bin_dir": "bin"}, "bin_dir", "absolute path"),
    ({"partition": "gpu;rm"}, "partition", "letters, digits"),
    ({"account": "x" * 65}, "account", "1-64"),
    ({"qos": "a b"}, "qos", "letters, digits"),
    ({"time_limit_s": 0}, "time_limit_s", "greater than or equal to 1"),
    ({"cpus_per_node": -1}, "cpus_per_node", "greater than or equal to 0"),
    ({"mem": "16GB"}, "mem", "K, M, G or T"),
    ({"mem": "0"}, "mem", "positive integer"),
    ({"gres": "gpu:a100:2"}, "gres", "name:type"),
    ({"command_timeout_s": 0}, "command_timeout_s", "greater than 0"),
    ({"preempt_signal": "KILL"}, "preempt_signal", "not a signal a job can catch"),
    ({"checkpoint_signal": "SIGFOO"}, "checkpoint_signal", "not a signal"),
    ({"extra_args": ["--wrap=rm -rf /"]}, "extra_args.0", "'--wrap=rm -rf /' is not allowed"),
    ({"extra_args": ["--exclusive", "-w", "n1"]}, "extra_args.1", "'-w' is not allowed"),
    ({"extra_args": ["--constraint=a b"]}, "extra_args.0", "without spaces"),
    ({"extra_args": ["--exclusive=user"]}, "extra_args.0", "not allowed"),
    ({"extra_args": ["--constraint"]}, "extra_args.0", "not allowed"),
    ({"mem": "8G", "extra_args": ["--mem-per-cpu=1G"]}, "extra_args", "exclude each other"),
    ({"priority_map": [{"min_priority": 1, "nice": -5}]}, "priority_map.0.nice", "negative nice needs root"),
    ({"priority_map": [{"min_priority": 1, "qos": "bad qos"}]}, "priority_map.0.qos", "letters, digits"),
    ({"priority_map": [{"qos": "x"}]}, "priority_map.0.min_priority", "Field required"),
    ({"priority_map": [{"min_priority": 1, "colour": "x"}]}, "priority_map.0.colour", "unknown setting"),
    ({"priority_map": [{"min_priority": 1}, {"min_priority": 1}]}, "priority_map", "same min_priority"),
    ({"surprise": 1}, "surprise", "unknown setting"),
])
def test_settings_errors_name_the_field(data, path, words):
    errors = settings_errors({"state_dir": "/shared/ty", **data} if data else data)
    assert path in errors, errors
    assert words.lower() in errors[path].lower(), errors[path]
    with pytest.raises(ValidationError):
        SlurmSettings.model_validate({"state_dir": "/shared/ty", **data} if data else data)


def test_settings_errors_of_a_non_object_and_of_several_fields():
    assert "object" in settings_errors([])[""]
    errors = settings_errors({"state_dir": "x", "mem": "lots", "ssh_port": -1})
    assert set(errors) == {"state_dir", "mem", "ssh_port"}


def test_settings_accept_good_values():
    s = settings(login="me@login1", ssh_key="/keys/id_ed25519", ssh_port=2222, known_hosts="/keys/known_hosts",
                 slurm_conf="/etc/slurm/slurm.conf", bin_dir="/opt/slurm/bin", partition="gpu", account="ml",
                 qos="normal", time_limit_s=3600, cpus_per_node=16, mem="64G", gres="gpu:a100",
                 preempt_signal="SIGINT", checkpoint_signal="usr2",
                 extra_args=["--constraint=a100&ib", "--exclude=n[1-2]", "--exclusive", "--reservation=r1"])
    assert (s.preempt_signal, s.checkpoint_signal) == ("INT", "USR2")


def test_priority_bands_highest_at_or_below_applies():
    s = settings(priority_map=[{"min_priority": 100, "qos": "urgent"}, {"min_priority": 0, "qos": "normal"},
                               {"min_priority": 50, "qos": "high", "nice": 10}])
    assert s.band(-1) is None
    assert s.band(0).qos == "normal" and s.band(49).qos == "normal"
    assert s.band(50).qos == "high" and s.band(99).nice == 10
    assert s.band(1000).qos == "urgent"

# -- sbatch argv and the batch script ------------------------------------------------------------


def submitted(b, g):
    b.submit(g)
    return b.runner.calls[-1]


def test_sbatch_argv_minimal():
    b = backend()
    argv = submitted(b, gang())
    assert argv == ["sbatch", "--parsable", "--job-name=trainyard-7-a2", "--comment=trainyard:gpu", "--nodes=2",
                    "--ntasks-per-node=1", "--no-requeue", "--chdir=/shared/ty/trainyard-7-a2",
                    "--output=/shared/ty/trainyard-7-a2/slurm-%j.out", "--export=HOME,PATH,USER,LOGNAME,LANG",
                    "/shared/ty/trainyard-7-a2/job.sbatch"]
    assert b.runner.calls[0][:2] == ["squeue", "--me"]


def test_sbatch_argv_every_option():
    b = backend(partition="p", account="acct", qos="q", time_limit_s=90061, cpus_per_node=8, mem="32G",
                gres="gpu:h100", extra_args=["--constraint=ib", "--exclusive"])
    argv = submitted(b, gang(gpus_per_node=4))
    assert argv[10:] == ["--partition=p", "--account=acct", "--qos=q", "--time=1-01:01:01", "--cpus-per-task=8",
                         "--mem=32G", "--gres=gpu:h100:4", "--constraint=ib", "--exclusive",
                         "/shared/ty/trainyard-7-a2/job.sbatch"]


def test_gang_overrides_time_and_cpus():
    b = backend(time_limit_s=3600, cpus_per_node=8)
    argv = submitted(b, gang(time_limit_s=59, cpus_per_node=32, gpus_per_node=0))
    assert "--time=0-00:00:59" in argv and "--cpus-per-task=32" in argv
    assert not any(a.startswith("--gres") for a in argv)


@pytest.mark.parametrize("seconds, text", [(1, "0-00:00:01"), (60, "0-00:01:00"), (3600, "0-01:00:00"),
                                           (86400, "1-00:00:00"), (8 * 86400 + 3725, "8-01:02:05")])
def test_time_format(seconds, text):
    assert format_time_limit(seconds) == text


def test_priority_band_overrides_partition_and_qos_and_sets_nice():
    bands = [{"min_priority": 0, "qos": "low", "nice": 100}, {"min_priority": 10, "partition": "fast", "qos": "high"}]
    b = backend(partition="base", qos="normal", priority_map=bands)
    hi = submitted(b, gang(priority=20))
    assert "--partition=fast" in hi and "--qos=high" in hi and not any(a.startswith("--nice") for a in hi)
    lo = submitted(b, gang(priority=5))
    assert "--partition=base" in lo and "--qos=low" in lo and "--nice=100" in lo
    none = submitted(b, gang(priority=-3))
    assert "--partition=base" in none and "--qos=normal" in none


def test_batch_script_quotes_env_and_command():
    g = gang(env={"TRAINYARD_URL": "http://x:1/a b", "QUOTE": "it's $HOME `id`"}, command=("run", "a b", "$x"))
    script = batch_script(g, "gpu")
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash" and "set -eu" in lines
    assert "export QUOTE='it'\"'\"'s $HOME `id`'" in lines
    assert "export TRAINYARD_URL='http://x:1/a b'" in lines
    assert lines.index("export SLURM_EXPORT_ENV=ALL") > lines.index("export QUOTE='it'\"'\"'s $HOME `id`'")
    assert lines[-1] == ('exec srun --kill-on-bad-exit=0 --ntasks-per-node=1 --nodes="$SLURM_JOB_NUM_NODES" '
                         "run 'a b' '$x'")
    assert shlex.split(lines[-1])[-3:] == ["run", "a b", "$x"]


def test_submit_writes_the_script_where_sbatch_reads_it():
    b = backend()
    b.submit(gang())
    assert b.runner.files["/shared/ty/trainyard-7-a2/job.sbatch"].startswith("#!/bin/bash\n")


@pytest.mark.parametrize("g, words", [
    (gang(env={"lower": "x"}), "environment name"),
    (gang(env={"A": "x\0y"}), "NUL"),
    (gang(command=()), "no command"),
    (gang(nodes=0), "at least one node"),
    (gang(time_limit_s=0), "time limit"),
    (gang(gpus_per_node=-1), "gpus_per_node"),
])
def test_bad_gangs_are_refused_before_anything_runs(g, words):
    b = backend()
    with pytest.raises(SubmitRefused, match=words):
        b.submit(g)
    assert "sbatch" not in b.runner.programs() and not b.runner.files

# -- submit: idempotency, ids, errors -------------------------------------------------------------


def test_submit_returns_the_existing_job_of_the_tag():
    listing = ("55|trainyard-7-a2|RUNNING|trainyard:other\n"
               "61|trainyard-7-a2|PENDING|trainyard:gpu\n"
               "58|trainyard-7-a2|PENDING|trainyard:gpu\n")
    b = backend(FakeRunner(squeue=[(0, listing, "")]))
    assert b.submit(gang()) == Handle("slurm:gpu", "58")
    assert b.runner.programs() == ["squeue"] and not b.runner.files
    assert b.runner.calls[0] == ["squeue", "--me", "--noheader", "--states=all", "--name=trainyard-7-a2",
                                 "--format=%i|%j|%T|%k"]


def test_submit_ignores_a_same_named_job_without_our_comment():
    b = backend(FakeRunner(squeue=[(0, "55|trainyard-7-a2|RUNNING|\n", "")], sbatch=[(0, "77\n", "")]))
    assert b.submit(gang()) == Handle("slurm:gpu", "77")


def test_submit_does_not_sbatch_when_squeue_fails():
    b = backend(FakeRunner(squeue=[(1, "", "slurm_load_jobs error: Unable to contact slurm controller")]))
    with pytest.raises(BackendError) as e:
        b.submit(gang())
    assert not isinstance(e.value, SubmitRefused) and "sbatch" not in b.runner.programs()


@pytest.mark.parametrize("out, job_id", [("123\n", "123"), ("123;cluster\n", "123"),
                                         ("sbatch: warning: x\n456;c2\n", "456")])
def test_parsable_ids(out, job_id):
    assert parse_parsable(out) == job_id
    assert backend(FakeRunner(sbatch=[(0, out, "")])).submit(gang()).id == job_id


@pytest.mark.parametrize("out", ["", "Submitted batch job 12", "12abc"])
def test_unparsable_sbatch_output_is_a_backend_error(out):
    with pytest.raises(BackendError, match="no job id"):
        parse_parsable(out)


@pytest.mark.parametrize("stderr", [
    "sbatch: error: Batch job submission failed: Invalid partition name specified",
    "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
    "sbatch: error: Batch job submission failed: Invalid qos specification",
    "sbatch: error: Batch job submission failed: Requested node configuration is not available",
    "sbatch: error: Batch job submission failed: More processors requested than permitted",
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's "
    "size and/or time limits)",
    "sbatch: error: Invalid generic resource (gres) specification",
    "sbatch: error: Batch job submission failed: Requested time limit is invalid (missing or exceeds some limit)",
])
def test_sbatch_refusals(stderr):
    b = backend(FakeRunner(sbatch=[(1, "", stderr)]))
    with pytest.raises(SubmitRefused) as e:
        b.submit(gang())
    assert "sbatch:" not in str(e.value) and "error:" not in str(e.value)
    assert str(e.value) in stderr


@pytest.mark.parametrize("answer", [
    (1, "", "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"),
    (1, "", "sbatch: error: Batch job submission failed: Socket timed out on send/recv operation"),
    (1, "", "sbatch: error: slurm_persist_conn_open_without_init: failed to open persistent connection: "
            "Connection refused"),
    (1, "", "sbatch: error: something new"),
    BackendError("ssh me@login failed: Connection closed"),
    BackendError("sbatch did not answer within 30 s"),
])
def test_sbatch_transient_failures_are_backend_errors(answer):
    b = backend(FakeRunner(sbatch=[answer]))
    with pytest.raises(BackendError) as e:
        b.submit(gang())
    assert not isinstance(e.value, SubmitRefused)

# -- status ---------------------------------------------------------------------------------------


def status_of(answers, *ids):
    b = backend(FakeRunner(**answers))
    handles = [Handle("slurm:gpu", i) for i in ids]
    return b, b.status(handles)


def test_status_asks_squeue_once_for_all_handles():
    out = ("101|RUNNING|2024-05-01T10:00:00|gpu-[1-2]|trainyard-7-a2|None\n"
           "102|PENDING|N/A|(null)|trainyard-8-a1|Priority\n")
    b, st = status_of({"squeue": [(0, out, "")]}, "101", "102")
    assert b.runner.calls == [["squeue", "--noheader", "--states=all", "--jobs=101,102",
                               "--format=%i|%T|%S|%N|%j|%r"]]
    assert st[Handle("slurm:gpu", "101")] == backends.HandleStatus(State.RUNNING, nodes=("gpu-1", "gpu-2"),
                                                                   source="squeue")
    p = st[Handle("slurm:gpu", "102")]
    assert (p.state, p.reason, p.category, p.eta, p.source) == (State.PENDING, "Priority", "priority", None, "squeue")


@pytest.mark.parametrize("state, reason, expected, words", [
    ("PENDING", "Resources", State.PENDING, "Resources"),
    ("CONFIGURING", "None", State.PENDING, "CONFIGURING"),
    ("REQUEUED", "None", State.PENDING, "REQUEUED"),
    ("REQUEUE_HOLD", "JobHeldAdmin", State.PENDING, "REQUEUE_HOLD: JobHeldAdmin"),
    ("RESV_DEL_HOLD", "None", State.PENDING, "RESV_DEL_HOLD"),
    ("RUNNING", "None", State.RUNNING, ""),
    ("COMPLETING", "None", State.RUNNING, ""),
    ("SUSPENDED", "None", State.RUNNING, "SUSPENDED"),
    ("STOPPED", "None", State.RUNNING, "STOPPED"),
    ("COMPLETED", "None", State.SUCCEEDED, ""),
    ("FAILED", "NonZeroExitCode", State.FAILED, "FAILED: NonZeroExitCode"),
    ("OUT_OF_MEMORY", "OutOfMemory", State.FAILED, "OUT_OF_MEMORY: OutOfMemory"),
    ("TIMEOUT", "TimeLimit", State.FAILED, "TIMEOUT: TimeLimit"),
    ("NODE_FAIL", "None", State.FAILED, "NODE_FAIL"),
    ("BOOT_FAIL", "None", State.FAILED, "BOOT_FAIL"),
    ("DEADLINE", "None", State.FAILED, "DEADLINE"),
    ("PREEMPTED", "None", State.PREEMPTED, ""),
    ("CANCELLED", "None", State.CANCELLED, ""),
    ("CANCELLED by 1000", "", State.CANCELLED, ""),
    ("WEIRD", "", State.UNKNOWN, "unrecognised Slurm state"),
])
def test_state_mapping(state, reason, expected, words):
    s = to_status(state, reason, source="squeue")
    assert s.state == expected and words in s.reason and s.source == "squeue"
    if state in ("REQUEUED", "REQUEUE_HOLD", "RESV_DEL_HOLD"):
        assert s.category == "held"
    if state == "CONFIGURING":
        assert s.category == "resources"


@pytest.mark.parametrize("reason, category", [
    ("Resources", "resources"), ("Nodes required for job are DOWN, DRAINED or reserved for jobs in higher "
                                 "priority partitions", "resources"),
    ("ReqNodeNotAvail, UnavailableNodes:n1", "resources"), ("BeginTime", "resources"),
    ("Reservation", "resources"), ("Priority", "priority"),
    ("QOSMaxJobsPerUserLimit", "limits"), ("QOSGrpGRES", "limits"), ("QOSMaxGRESPerUser", "limits"), ("QOSGrpCpuLimit", "limits"),
    ("AssocGrpGRES", "limits"), ("AssocMaxJobsLimit", "limits"), ("PartitionTimeLimit", "limits"),
    ("PartitionNodeLimit", "limits"), ("MaxJobsPerUser", "limits"),
    ("JobHeldUser", "held"), ("JobHeldAdmin", "held"), ("HeldByUser", "held"),
    ("Dependency", "dependency"), ("DependencyNeverSatisfied", "dependency"),
    ("None", "other"), ("", "other"), ("PartitionDown", "other"),
])
def test_pending_categories(reason, category):
    assert pending_category(reason) == category
    assert category in backends.PENDING_CATEGORIES


def test_pending_eta_from_the_start_time():
    when = "2031-01-02T03:04:05"
    expected = time.mktime(time.strptime(when, "%Y-%m-%dT%H:%M:%S"))
    _, st = status_of({"squeue": [(0, f"5|PENDING|{when}|(null)|trainyard-1-a1|Resources\n", "")]}, "5")
    s = st[Handle("slurm:gpu", "5")]
    assert (s.eta, s.category) == (expected, "resources")
    for text in ("N/A", "Unknown", "None", ""):
        assert parse_start(text) is None


@pytest.mark.parametrize("text, names", [
    ("gpu-[1-2,4]", ("gpu-1", "gpu-2", "gpu-4")),
    ("n[01-03]", ("n01", "n02", "n03")),
    ("n[098-101]", ("n098", "n099", "n100", "n101")),
    ("a,b", ("a", "b")),
    ("node1", ("node1",)),
    ("gpu-[1-2],cpu-[7,9]", ("gpu-1", "gpu-2", "cpu-7", "cpu-9")),
    ("r[1-2]-n[1-2]", ("r1-n1", "r1-n2", "r2-n1", "r2-n2")),
    ("n[1]", ("n1",)),
    ("", ()), ("(null)", ()), ("N/A", ()),
])
def test_hostlist_expansion(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["n[1-2", "n1-2]", "n[3-1]", "n[a-b]", "n[[1]]"])
def test_bad_hostlists(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_unreadable_hostlist_is_unknown_not_a_crash():
    _, st = status_of({"squeue": [(0, "5|RUNNING|x|n[1-|trainyard-1-a1|None\n", "")]}, "5")
    assert st[Handle("slurm:gpu", "5")].state == State.UNKNOWN


@pytest.mark.parametrize("text, code", [("0:0", 0), ("1:0", 1), ("0:9", 137), ("0:15", 143), ("2:9", 2),
                                        ("", None), ("x:y", None)])
def test_exit_codes(text, code):
    assert parse_exit_code(text) == code


def test_empty_squeue_falls_through_to_sacct():
    sacct = "101|COMPLETED|0:0|n1|2024-01-01T00:00:00\n102|FAILED|3:0|n[1-2]|2024-01-01T00:00:00\n"
    b, st = status_of({"squeue": [(0, "", "")], "sacct": [(0, sacct, "")]}, "101", "102")
    assert b.runner.calls[1] == ["sacct", "--noheader", "--parsable2", "--allocations", "--jobs=101,102",
                                 "--format=JobIDRaw,State,ExitCode,NodeList,Start"]
    assert st[Handle("slurm:gpu", "101")] == backends.HandleStatus(State.SUCCEEDED, exit_code=0, source="sacct")
    f = st[Handle("slurm:gpu", "102")]
    assert (f.state, f.exit_code, f.reason, f.source) == (State.FAILED, 3, "FAILED", "sacct")


def test_only_the_missing_ids_go_to_sacct():
    out = "101|RUNNING|N/A|n1|trainyard-7-a2|None\n"
    b, st = status_of({"squeue": [(0, out, "")], "sacct": [(0, "102|TIMEOUT|0:15|n2|x\n", "")]}, "101", "102")
    assert "--jobs=102" in b.runner.calls[1]
    t = st[Handle("slurm:gpu", "102")]
    assert (t.state, t.exit_code, t.reason) == (State.FAILED, 143, "TIMEOUT")


def test_squeue_invalid_id_means_not_listed():
    sacct = "101|CANCELLED by 1000|0:15|n1|x\n"
    _, st = status_of({"squeue": [(1, "", "slurm_load_jobs error: Invalid job id specified\n")],
                       "sacct": [(0, sacct, "")]}, "101")
    assert st[Handle("slurm:gpu", "101")].state == State.CANCELLED


def test_accounting_disabled_falls_back_to_scontrol():
    one = ("JobId=101 JobName=trainyard-7-a2 UserId=me(1000) JobState=COMPLETED Reason=None Dependency=(null) "
           "ExitCode=0:0 RunTime=00:01:00 StartTime=2024-01-01T00:00:00 NodeList=n[1-2] BatchHost=n1")
    running = "JobId=102 JobName=t JobState=RUNNING Reason=None ExitCode=0:0 NodeList=gpu-[3,5]"
    b, st = status_of({"squeue": [(0, "", "")],
                       "sacct": [(1, "", "sacct: error: Slurm accounting storage is disabled\n")],
                       "scontrol": [(0, one, ""), (0, running, "")]}, "101", "102")
    assert b.runner.calls[2] == ["scontrol", "show", "job", "101", "--oneliner"]
    assert st[Handle("slurm:gpu", "101")] == backends.HandleStatus(State.SUCCEEDED, exit_code=0, source="scontrol")
    r = st[Handle("slurm:gpu", "102")]
    assert (r.state, r.nodes) == (State.RUNNING, ("gpu-3", "gpu-5"))


def test_scontrol_invalid_id_is_unknown_not_gone():
    b, st = status_of({"squeue": [(0, "", "")], "sacct": [(0, "", "")],
                       "scontrol": [(1, "", "slurm_load_jobs error: Invalid job id specified\n")]}, "101")
    s = st[Handle("slurm:gpu", "101")]
    assert (s.state, s.reason, s.source) == (State.UNKNOWN, "not known to Slurm any more", "scontrol")
    assert b.runner.programs() == ["squeue", "sacct", "scontrol"]


@pytest.mark.parametrize("answers, source, words", [
    ({"squeue": [(1, "", "Unable to contact slurm controller")]}, "squeue", "Unable to contact"),
    ({"squeue": [BackendError("ssh me@login failed: timeout")]}, "squeue", "ssh me@login failed"),
    ({"squeue": [(0, "", "")], "sacct": [(1, "", "sacct: error: Problem talking to the database")]}, "sacct",
     "Problem talking"),
    ({"squeue": [(0, "", "")], "sacct": [BackendError("sacct did not answer within 30 s")]}, "sacct", "30 s"),
    ({"squeue": [(0, "", "")], "sacct": [(0, "", "")], "scontrol": [(1, "", "Socket timed out")] * 2}, "scontrol",
     "Socket timed out"),
    ({"squeue": [(0, "", "")], "sacct": [(0, "", "")], "scontrol": [(0, "", "")]}, "scontrol", "said nothing"),
])
def test_command_failures_answer_unknown(answers, source, words):
    _, st = status_of(answers, "101", "102")
    for i in ("101", "102"):
        s = st[Handle("slurm:gpu", i)]
        assert (s.state, s.source) == (State.UNKNOWN, source) and words in s.reason
        assert not s.state.ended


def test_every_handle_is_answered_even_foreign_ones():
    foreign, bad = Handle("agents", "101"), Handle("slurm:gpu", "1;rm")
    b = backend(FakeRunner(squeue=[(0, "101|RUNNING|N/A|n1|t|None\n", "")]))
    st = b.status([H, H, foreign, bad])
    assert set(st) == {H, foreign, bad}
    assert st[H].state == State.RUNNING and st[foreign].state == st[bad].state == State.UNKNOWN
    assert b.status([]) == {} and len(b.runner.calls) == 1

# -- cancel, signal -------------------------------------------------------------------------------


def test_cancel_with_grace_signals_the_steps_without_grace_kills():
    b = backend(preempt_signal="INT")
    b.cancel(H, 30)
    b.cancel(H, 0)
    assert b.runner.calls == [["scancel", "--signal=INT", "101"], ["scancel", "101"]]


@pytest.mark.parametrize("stderr", ["scancel: error: Kill job error on job id 101: Job/step already completing "
                                    "or completed", "scancel: error: Kill job error on job id 101: Invalid job id "
                                    "specified"])
def test_cancel_of_an_ended_job_is_success(stderr):
    backend(FakeRunner(scancel=[(1, "", stderr)])).cancel(H, 0)


def test_cancel_failures_raise():
    with pytest.raises(BackendError, match="Unable to contact"):
        backend(FakeRunner(scancel=[(1, "", "Unable to contact slurm controller")])).cancel(H, 0)
    with pytest.raises(ValueError):
        backend().cancel(Handle("slurm:other", "101"), 0)


def test_signal_sends_the_configured_signals_to_the_steps():
    b = backend(checkpoint_signal="USR2")
    b.signal(H, "checkpoint")
    b.signal(H, "preempt")
    assert b.runner.calls == [["scancel", "--signal=USR2", "101"], ["scancel", "--signal=TERM", "101"]]
    assert not any(a in ("--batch", "--full", "-b", "-f") for c in b.runner.calls for a in c)
    with pytest.raises(ValueError):
        b.signal(H, "KILL")

# -- reconcile ------------------------------------------------------------------------------------


def test_reconcile_adopts_live_cancels_orphans_ignores_others():
    listing = ("10|trainyard-1-a1|RUNNING|trainyard:gpu\n"
               "11|trainyard-2-a1|PENDING|trainyard:gpu\n"
               "12|trainyard-3-a1|RUNNING|trainyard:cpu\n"
               "13|my-notebook|RUNNING|\n"
               "14|trainyard-4-a1|RUNNING|someone else's\n"
               "15|not-a-tag|RUNNING|trainyard:gpu\n"
               "16|trainyard-1-a1|PENDING|trainyard:gpu\n")
    b = backend(FakeRunner(squeue=[(0, listing, "")]))
    r = b.reconcile({"trainyard-1-a1", "trainyard-3-a1"})
    assert r.adopted == (("trainyard-1-a1", Handle("slurm:gpu", "10")),)
    assert r.cancelled == (("trainyard-2-a1", Handle("slurm:gpu", "11")),
                           ("trainyard-1-a1", Handle("slurm:gpu", "16")))
    assert b.runner.calls == [["squeue", "--me", "--noheader", "--format=%i|%j|%T|%k"],
                              ["scancel", "11"], ["scancel", "16"]]


def test_reconcile_failed_squeue_raises_and_failed_scancel_is_left_for_next_round():
    with pytest.raises(BackendError):
        backend(FakeRunner(squeue=[(1, "", "Socket timed out")])).reconcile(set())
    b = backend(FakeRunner(squeue=[(0, "10|trainyard-1-a1|RUNNING|trainyard:gpu\n", "")],
                           scancel=[(1, "", "Socket timed out")]))
    assert b.reconcile(set()) == backends.Reconciled()

# -- the backend object, put_file ---------------------------------------------------------------


def test_backend_surface():
    b = backend()
    assert isinstance(b, backends.LaunchBackend) and b.name == "slurm:gpu"
    assert b.capabilities == backends.Capabilities(native_gang=True, requeue=False, suspend=False, elastic=False)
    assert isinstance(SlurmBackend("p", settings()).runner, LocalRunner)
    ssh = build_runner(settings(login="me@login1", ssh_key="/k/id"))
    assert isinstance(ssh, SshRunner) and ssh.port == 22


def test_put_file_modes_with_the_local_runner(tmp_path):
    b = SlurmBackend("gpu", settings(state_dir=str(tmp_path / "state")))
    path = b.put_file("trainyard-7-a2", "agents.json", '{"a": 1}')
    assert path == f"{tmp_path}/state/trainyard-7-a2/agents.json"
    assert open(path).read() == '{"a": 1}'
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    b.put_file("trainyard-7-a2", "agents.json", "again")
    assert open(path).read() == "again" and os.listdir(os.path.dirname(path)) == ["agents.json"]
    for tag, name in (("../x", "a"), ("trainyard-7-a2", "../a"), ("trainyard-7-a2", ".hidden"),
                      ("trainyard-7-a2", "a/b"), ("trainyard-7-a2", "")):
        with pytest.raises(ValueError):
            b.put_file(tag, name, "x")

# -- runners --------------------------------------------------------------------------------------


def _script(folder, name, body):
    p = folder / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(0o755)


def test_local_runner_runs_bin_dir_programs_for_real(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _script(bin_dir, "sbatch", 'echo "$SLURM_CONF" >&2; for a in "$@"; do echo "[$a]"; done\n')
    _script(bin_dir, "squeue", "cat; exit 3\n")
    _script(bin_dir, "slow", "exec sleep 5\n")
    r = LocalRunner(bin_dir=str(bin_dir), slurm_conf="/etc/slurm/test.conf")
    rc, out, err = r.run(["sbatch", "a b", "$HOME", "';x"], timeout=5)
    assert (rc, out, err) == (0, "[a b]\n[$HOME]\n[';x]\n", "/etc/slurm/test.conf\n")
    assert r.run(["squeue"], timeout=5, input="piped") == (3, "piped", "")
    with pytest.raises(BackendError, match="did not answer"):
        r.run(["slow"], timeout=0.2)
    with pytest.raises(BackendError, match="cannot run"):
        r.run(["missing"], timeout=5)


def test_ssh_runner_argv_and_quoting():
    r = SshRunner("me@login1", "/k/id", port=2222, bin_dir="/opt/slurm/bin", slurm_conf="/etc/slurm.conf")
    remote = r.remote_command(["squeue", "--format=%i|%T", "a b;rm -rf /"])
    assert remote == "env SLURM_CONF=/etc/slurm.conf /opt/slurm/bin/squeue '--format=%i|%T' 'a b;rm -rf /'"
    assert shlex.split(remote)[2:] == ["/opt/slurm/bin/squeue", "--format=%i|%T", "a b;rm -rf /"]
    argv = r.ssh_argv(remote)
    assert argv[:5] == ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
    assert argv[-7:] == ["-i", "/k/id", "-p", "2222", "me@login1", "--", remote]
    assert "UserKnownHostsFile" not in " ".join(argv)
    strict = SshRunner("login1", "/k/id", known_hosts="/k/known_hosts").ssh_argv("true")
    assert "StrictHostKeyChecking=yes" in strict and "UserKnownHostsFile=/k/known_hosts" in strict
    with pytest.raises(ValueError):
        SshRunner("-oProxyCommand=x", "/k/id")


def test_ssh_runner_over_a_fake_ssh(tmp_path):
    """A stand-in ssh that runs the remote command with sh: write_private's modes and rename, and
    rc 255 as ssh's own failure."""
    _script(tmp_path, "ssh", 'while [ "$1" != "--" ]; do shift; done; shift; exec sh -c "$1"\n')
    _script(tmp_path, "ssh255", "echo 'Permission denied (publickey)' >&2; exit 255\n")
    r = SshRunner("login1", "/k/id", ssh=str(tmp_path / "ssh"))
    target = tmp_path / "state" / "trainyard-1-a1" / "job.sbatch"
    r.write_private(str(target), "echo 'hi'\n")
    assert target.read_text() == "echo 'hi'\n"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    assert os.listdir(target.parent) == ["job.sbatch"]
    assert r.run(["echo", "a b", "$HOME"], timeout=5) == (0, "a b $HOME\n", "")
    with pytest.raises(BackendError, match="Permission denied"):
        SshRunner("login1", "/k/id", ssh=str(tmp_path / "ssh255")).run(["squeue"], timeout=5)


def test_unhealthy_nodes_are_those_slurm_drains_downs_or_fails():
    listing = ("gpu-1|draining|disk errors\ngpu-1|draining|disk errors\n"   # one line per partition
               "gpu-2|mixed|none\ngpu-3|down*|Not responding\ngpu-4|drained|bad gpu|really\n"
               "gpu-5|idle*|none\ngpu-6|allocated+|none\ngpu-7|failing|health check\nother|down|not asked\n")
    b = backend(FakeRunner(sinfo=[(0, listing, "")]))
    bad = b.unhealthy_nodes(["gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-6", "gpu-7", "bad name;rm"])
    assert bad == {"gpu-1": ("draining", "disk errors"), "gpu-3": ("down", "Not responding"),
                   "gpu-4": ("drained", "bad gpu|really"), "gpu-7": ("failing", "health check")}
    call = b.runner.calls[0]
    assert call[:3] == ["sinfo", "--noheader", "--Node"] and call[3] == "--nodes=gpu-1,gpu-2,gpu-3,gpu-4,gpu-5,gpu-6,gpu-7"
    assert backend(FakeRunner()).unhealthy_nodes([]) == {}
    with pytest.raises(BackendError, match="sinfo failed"):
        backend(FakeRunner(sinfo=[(1, "", "Unable to contact slurm controller")])).unhealthy_nodes(["gpu-1"])
