"""The automatic parallel planner (issue 13): pure (stdlib + pydantic), no Django, no torch.

inputs.py parses the request, cost.py prices a candidate (memory, step time), search.py finds
every plan that fits (best first) and why the others do not, constants.py holds the per-device
constants (DEFAULT_GPU fit on published runs, published.py + fit.py), explain.py says why.
"""
from .constants import DEFAULT_CPU, DEFAULT_GPU, DeviceConstants
from .cost import Candidate, MemoryBreakdown, TimeBreakdown, memory, step_time
from .inputs import PlanInputError, PlanRequest, parse_plan_request
from .search import plan, plan_dict
from .job import plan_for_job, spec_parallel

__all__ = ["DEFAULT_CPU", "DEFAULT_GPU", "Candidate", "DeviceConstants", "MemoryBreakdown", "PlanInputError",
           "PlanRequest", "TimeBreakdown", "memory", "parse_plan_request", "plan", "plan_dict", "plan_for_job",
           "spec_parallel", "step_time"]
