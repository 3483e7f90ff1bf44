"""diffuserve: a serving engine for diffusion models."""

__version__ = "0.1.0"
