"""Integrations of clattn with other libraries (optional extras; clattn itself needs none).

* :mod:`clattn.integrations.transformers`: Hugging Face transformers attention backend
  ``attn_implementation="clattn"`` with a paged KV cache on the OpenCL device (extra ``hf``).

Nothing is imported here: importing this package never imports torch or transformers.
"""
