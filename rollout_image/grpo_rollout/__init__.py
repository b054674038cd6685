"""grpo_rollout"""
