"""The experiments' writes: submit, the control worker's advance, stop, continue a trial."""
from jobs.experiments.services.advance import experiment_advance, experiments_advance
from jobs.experiments.services.control import experiment_stop, trial_continue
from jobs.experiments.services.events import experiment_event
from jobs.experiments.services.submit import experiment_submit, trial_create

__all__ = ["experiment_advance", "experiment_event", "experiment_stop", "experiment_submit", "experiments_advance",
           "trial_continue", "trial_create"]
