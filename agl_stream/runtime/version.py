"""agl-stream's version (the package's metadata says the same)."""

__version__ = "0.1.0"
