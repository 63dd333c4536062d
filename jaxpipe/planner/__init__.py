"""Seesaw's cost model, the layout planner and a simulator that drives the real scheduler
policies (`jaxpipe.scheduler`) with step times from the cost model. None of it runs jax: the
calibration that times real steps and the papers' reproductions are tools, in
`jaxpipe_bench`. `import jaxpipe` loads none of this package; the engine imports it only to
resolve `prefill="auto"` / `decode="auto"`.

    costmodel.py  Seesaw's analytic cost model (appendix A) of one layout, ep included
    planner.py    the prefill and decode layouts (c_p, c_d) the cost model predicts best
    simulate.py   the real policies over the scheduler's loop, step times from the cost model
    hostcost.py   the host's time per micro-batch (preparing, sampling), from the papers
    virtual_engines.py  vLLM V0's pipeline parallelism: pp schedulers, 1/pp of the KV each
    workloads.py  seeded request-length workloads (sharegpt, arxiv, constant:IN:OUT)
    cli.py        `python -m jaxpipe.planner` (__main__.py): the planner's table
"""

from jaxpipe.planner.costmodel import CostModel
from jaxpipe.planner.planner import Plan, choose_layouts, layout_name, plan
from jaxpipe.planner.workloads import Workload, make_workload

__all__ = ["CostModel", "Plan", "Workload", "choose_layouts", "layout_name", "make_workload",
           "plan"]
