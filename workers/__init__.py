"""Worker processes: runner, projector and trainer; and what they share at start-up."""
