"""Starting agl-stream's processes together and driving a run: Agent Lightning's
Trainer.fit, the demo, the held-out evaluation."""
