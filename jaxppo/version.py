"""The package version (a leaf module: checkpoints record it without importing the package)."""

__version__ = "0.4.0"
