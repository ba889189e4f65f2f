"""Other frameworks' APIs on agl-stream: Agent Lightning's store (agl)."""
