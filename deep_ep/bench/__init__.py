"""`deep-ep bench` and `deep-ep calibrate`: measurements of dispatch/combine on whatever is present.

- `deep_ep.bench.cases`: what a run measures (cases, options, inputs, traffic).
- `deep_ep.bench.timing`: eager timing, CUDA-graph capture and replay timing, kernel breakdown.
- `deep_ep.bench.torch_path`: the torch `all_to_all_single` path a user would write.
- `deep_ep.bench.runner`: the per-rank benchmark and `run()` (spawns the ranks, prints, writes).
- `deep_ep.bench.report`: the tables, the planner and issue checks, the JSON document and the plot.
- `deep_ep.bench.calibrate`: the planner's calibration (`deep_ep/data/hopper.json`).
"""

from __future__ import annotations

# Options of `deep-ep bench` (here, so that the CLI parser does not import torch)
DTYPES = ("fp8", "bf16")
ROUTINGS = ("uniform", "imbalanced")
DEFAULT_HOT_FRACTION = 0.5  # imbalanced routing: the share of tokens that prefer the hot rank's experts
