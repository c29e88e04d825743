"""longpatch inside a serving engine: vLLM's attention backend (``backend.py``, imported only by vLLM), its
plugin (``plugin.py``: the ``vllm.general_plugins`` entry point, enabled by ``LONGPATCH_CONFIG``) and the
engine-free part, the mapping of paged caches and packed batches to longpatch's routes (``pages.py``)."""
