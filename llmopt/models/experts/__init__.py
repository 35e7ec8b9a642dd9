"""Mixture of experts in llmopt's model: router, routed and shared experts, the auxiliary
losses and routing statistics (`llmopt.models.moe` holds the shapes, torch-free)."""

from llmopt.models.experts.layer import MoE, feed_forward, set_routing
from llmopt.models.experts.router import Router, Routing

__all__ = ["MoE", "Router", "Routing", "feed_forward", "set_routing"]
