"""capsulefs: every agent a host holds, mounted as a live capsule directory."""

__version__ = "0.1.0"
