"""The bench: plan methods × links experiments, run them on emulated nodes, record ``results.json`` (which it owns)."""

from lowband.bench.config import BenchConfig
from lowband.bench.job import BenchTable
from lowband.bench.methods import METHODS, BenchMethod, accepted_params, parse_method_list, parse_method_spec
from lowband.bench.plan import RunPlan, plan_runs

__all__ = ["METHODS", "BenchConfig", "BenchMethod", "BenchTable", "RunPlan", "accepted_params", "parse_method_list",
           "parse_method_spec", "plan_runs"]
