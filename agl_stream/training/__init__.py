"""The training loop: trajectories from the topics, adapters to training data, GRPO, the
trainer worker and its checkpoints. Modules that need torch import it themselves, so the
pure parts (trajectories, triplets, batching, advantages, checkpoints) load without it."""
