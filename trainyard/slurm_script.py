"""What `SlurmBackend.submit` hands sbatch: the batch script (`batch_script`) and sbatch's argv
(`sbatch_argv`), from a Gang and the pool's settings. Pure: no I/O.

The script starts the gang's command once per node with srun (one task per node; srun forwards
SIGTERM to the steps, and `scancel --signal` without --batch reaches them too). GPUs are asked for
as `--gres=<gres>:<n>`, a per-node count every Slurm version understands (--gpus-per-node needs
select/cons_tres).
"""
from __future__ import annotations

import posixpath
import re
import shlex

from .backends import Gang, SubmitRefused
from .slurm_parse import format_time_limit
from .slurm_settings import SlurmSettings

ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
# What the batch script inherits from the submitting environment (sbatch --export); the gang's own
# variables are set by the script itself, so nothing of the submit host's environment leaks.
EXPORTED = "HOME,PATH,USER,LOGNAME,LANG"
SCRIPT_NAME = "job.sbatch"


def comment(pool: str) -> str:
    """The --comment every job of this pool carries: how reconcile and submit know their own."""
    return f"trainyard:{pool}"


def batch_script(gang: Gang, pool: str) -> str:
    if not gang.command:
        raise SubmitRefused("the gang has no command to run")
    lines = ["#!/bin/bash", f"# {gang.tag}: written by Trainyard's Slurm backend (pool {pool})", "set -eu"]
    for name, value in sorted(gang.env.items()):
        if not ENV_NAME_RE.fullmatch(name):
            raise SubmitRefused(f"environment name {name!r} is not of the form [A-Z_][A-Z0-9_]*")
        if "\0" in str(value):
            raise SubmitRefused(f"environment variable {name} holds a NUL byte")
        lines.append(f"export {name}={shlex.quote(str(value))}")
    if any("\0" in a for a in gang.command):
        raise SubmitRefused("the gang's command holds a NUL byte")
    lines.append("export SLURM_EXPORT_ENV=ALL")
    lines.append('exec srun --kill-on-bad-exit=0 --ntasks-per-node=1 --nodes="$SLURM_JOB_NUM_NODES" '
                 + " ".join(shlex.quote(a) for a in gang.command))
    return "\n".join(lines) + "\n"


def sbatch_argv(gang: Gang, settings: SlurmSettings, pool: str, script_path: str) -> list[str]:
    """sbatch's argv for this gang: the fixed options, then the pool's and the gang's requests, the
    priority band's partition/QOS/nice over the pool's, the pool's extra_args, the script."""
    if gang.nodes < 1:
        raise SubmitRefused(f"a gang needs at least one node, got {gang.nodes}")
    job_dir = settings.job_dir(gang.tag)
    argv = ["sbatch", "--parsable", f"--job-name={gang.tag}", f"--comment={comment(pool)}", f"--nodes={gang.nodes}",
            "--ntasks-per-node=1", "--no-requeue", f"--chdir={job_dir}",
            f"--output={posixpath.join(job_dir, 'slurm-%j.out')}", f"--export={EXPORTED}"]
    band = settings.band(gang.priority)
    partition = (band and band.partition) or settings.partition
    qos = (band and band.qos) or settings.qos
    if partition:
        argv.append(f"--partition={partition}")
    if settings.account:
        argv.append(f"--account={settings.account}")
    if qos:
        argv.append(f"--qos={qos}")
    limit = gang.time_limit_s if gang.time_limit_s is not None else settings.time_limit_s
    if limit is not None:
        if limit < 1:
            raise SubmitRefused(f"time limit must be at least 1 s, got {limit}")
        argv.append(f"--time={format_time_limit(limit)}")
    cpus = gang.cpus_per_node or settings.cpus_per_node
    if cpus < 0:
        raise SubmitRefused(f"cpus_per_node must be >= 0, got {cpus}")
    if cpus:
        argv.append(f"--cpus-per-task={cpus}")
    if settings.mem:
        argv.append(f"--mem={settings.mem}")
    if gang.gpus_per_node < 0:
        raise SubmitRefused(f"gpus_per_node must be >= 0, got {gang.gpus_per_node}")
    if gang.gpus_per_node:
        argv.append(f"--gres={settings.gres}:{gang.gpus_per_node}")
    if band is not None and band.nice is not None:
        argv.append(f"--nice={band.nice}")
    argv.extend(settings.extra_args)
    argv.append(script_path)
    return argv
