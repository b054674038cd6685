"""grpo_trainer: the learner (data, FSDP2 policy and reference, algorithms, weight sender)."""
