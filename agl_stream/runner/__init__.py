"""The runner: claims rollouts from the tasks topic and executes agents on them."""
