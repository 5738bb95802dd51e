import pytest

from jobs import services
from jobs.models import Experiment

TEMPLATE = {"name": "exp", "train": {"steps": 40}, "checkpoint": {"every_steps": 5}}
SEARCH = {"metric": "loss", "mode": "min", "algorithm": "random", "max_trials": 4, "max_concurrent": 2, "seed": 1,
          "space": {"train.lr": {"choice": [0.003, 1e-7]}},
          "early_stopping": {"asha": {"min_steps": 10, "reduction": 2}}}


@pytest.fixture
def submit_experiment(user, nodes):
    def make(search=None, spec=None, name="lr search", who=None) -> Experiment:
        return services.experiment_submit(user=who or user, name=name, spec=spec or TEMPLATE,
                                          search={**SEARCH, **(search or {})})
    return make
