"""autotune: measure the largest micro-batch that fits, and keep the effective batch.

Importing this package does not import torch (the service image has none); the probe modules
import it when they are used.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
