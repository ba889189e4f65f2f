"""The read model: a pure fold of events into rows (fold.py), the projector that writes them
to PostgreSQL with its offsets (projector.py), queries over them (agl_stream.queries) and
replay into a fresh schema (replay.py)."""
