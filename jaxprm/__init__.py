"""jaxprm: process-reward RL for multi-turn LLM agents, in JAX.

The top-level package is the array core (layer 1): pure jitted kernels and the ``Batch`` pytree.
Models, sampler, server and trainer live in submodules (``jaxprm.models``, ``jaxprm.sampler``,
``jaxprm.serve``, ``jaxprm.train``) and are not imported here.
"""

from jaxprm.batch import Batch, RowData, bucket_size, pad_rows

__all__ = ["Batch", "RowData", "bucket_size", "pad_rows"]
