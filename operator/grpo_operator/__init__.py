"""grpo_operator"""
