"""Reinforcement learning from rewards (--objective grpo): rewards and the rollout."""
