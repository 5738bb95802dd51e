import json

from django.core.management.base import BaseCommand, CommandError

from jobs.core.errors import InvalidInput
from jobs.fleet.services.pools import pool_save


class Command(BaseCommand):
    help = ("Create or update a Slurm pool (issue 27) from JSON: its fields (max_nodes, slots_per_node, device, "
            "gpu_memory_gb, enabled, agent_python, agent_code_dir, agent_run_dir, agent_env) and `settings` (how to "
            "reach Slurm, partition, account, QOS, priority bands, time limit: trainyard.slurm.SlurmSettings). "
            "The same as the admin's Pools page; jobs use it with resources.pool: NAME.")

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("--json", required=True, help='e.g. {"max_nodes": 4, "settings": {"partition": "gpu", '
                                                          '"state_dir": "/shared/trainyard"}}')

    def handle(self, *args, name, json: str, **opts):
        try:
            fields = _loads(json)
            pool = pool_save(name, **fields)
        except InvalidInput as exc:
            raise CommandError("; ".join(f"{k}: {' '.join(v)}" for k, v in exc.errors.items())) from None
        self.stdout.write(f"pool {pool.name}: {pool.max_nodes} seat(s) of {pool.slots_per_node} {pool.device} slot(s), "
                          f"partition {pool.settings.get('partition')}")


def _loads(text: str) -> dict:
    try:
        fields = json.loads(text)
    except ValueError as exc:
        raise CommandError(f"--json: not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise CommandError("--json: an object of pool fields")
    return fields
