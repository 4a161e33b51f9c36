"""Callbacks: rollout generation, scoring and weight push."""
