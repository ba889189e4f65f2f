"""What a person or another system asks of agl-stream, as library calls under the CLI:
enqueue, cancel, requeue, rewards, resources, status."""
