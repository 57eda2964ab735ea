"""The cluster cost model behind ``qzero plan``: what each way of training puts on a cluster's
links and how long a step takes, as a projection (pure Python; no process group).

One role per module: :mod:`.cluster` (nodes, GPUs, links), :mod:`.traffic` (what NCCL sends
for a collective, rank to rank), :mod:`.cost` (a collective's time from its busiest port),
:mod:`.collectives` (the same in closed form for uniform collectives), :mod:`.payloads`
(bytes per element from qzero's formats), :mod:`.arms` (the collectives of each arm's step),
:mod:`.step` (overlap and the predicted step), :mod:`.recommend` (settings to use).
"""

from .arms import Arm, Call, Workload, calls, default_arms
from .cluster import NICS, SCOPES, Cluster, groups_of
from .collectives import collective_cost
from .cost import Cost, cost_of
from .payloads import Payload, gradient_payload, weight_payload
from .step import Prediction, predict
from .traffic import Flow, Traffic, all_to_all_traffic, ring_traffic

__all__ = ["Arm", "Call", "Cluster", "Cost", "Flow", "NICS", "Payload", "Prediction", "SCOPES", "Traffic",
           "Workload", "all_to_all_traffic", "calls", "collective_cost", "cost_of", "default_arms",
           "gradient_payload", "groups_of", "predict", "ring_traffic", "weight_payload"]
