"""The package version (a leaf, so any layer can report it without importing the public API)."""

__version__ = "0.1.0"
