"""Experiments (issue 25): a JobSpec template plus a search; each trial is an ordinary job. Searchers
(Optuna's samplers), early stopping (ASHA, a pure policy in policy/), the API, the experiment page."""
