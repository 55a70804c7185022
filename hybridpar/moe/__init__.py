"""Mixture of experts: router, fused experts, the MoE block, expert-parallel dispatch, the
load-balancing loss, the router z-loss, the aux-loss-free bias update."""

from hybridpar.moe.balance_loss import (
    balance_loss,
    empty_stats,
    expert_load,
    routing_stats,
    split_aux,
    stats_experts,
    z_loss,
)
from hybridpar.moe.bias_update import ExpertBiasUpdate
from hybridpar.moe.block import MoE, SharedExpert, combine, group_by_expert
from hybridpar.moe.dispatch import DispatchPlan, all_to_all, dispatch_plan
from hybridpar.moe.experts import Experts
from hybridpar.moe.grouped import grouped_linear, uses_grouped_mm
from hybridpar.moe.router import Router, Routing

__all__ = [
    "DispatchPlan",
    "ExpertBiasUpdate",
    "Experts",
    "MoE",
    "Router",
    "Routing",
    "SharedExpert",
    "all_to_all",
    "balance_loss",
    "combine",
    "dispatch_plan",
    "empty_stats",
    "expert_load",
    "group_by_expert",
    "grouped_linear",
    "routing_stats",
    "split_aux",
    "stats_experts",
    "uses_grouped_mm",
    "z_loss",
]
