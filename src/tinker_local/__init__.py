"""tinker-local: the Tinker training API served on your own hardware."""

__version__ = "0.1.0"
