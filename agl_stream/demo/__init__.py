"""The demo: a tiny model learns a small agent task from scratch with GRPO, on a CPU."""
