"""Autoscaling: one replica budget split between the pools' prefill, decode and expert-pool
deployments (docs/autoscaling.md). ``signals`` is the contract (observations in, targets out),
``policy`` the policies; both Ray-free."""

from deployments.autoscaling.signals import Budget, Decision, DeploymentSignal, Observation, Policy, Slo

__all__ = ["Budget", "Decision", "DeploymentSignal", "Observation", "Policy", "Slo"]
