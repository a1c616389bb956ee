"""The loop: stages, backends, seeding, data, rewards and the RL algorithm."""
