"""`agl-stream export`: datasets out of the read model, streamed in constant memory."""
