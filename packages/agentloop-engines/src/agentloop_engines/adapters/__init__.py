"""The engine adapters: one sub-package per engine, each the same shape (``server.py`` holds the
adapter class; helpers beside it), plus what several adapters share.

* :mod:`~agentloop_engines.adapters.hf`: ``HFServer`` over transformers (the ``[hf]`` extra);
* :mod:`~agentloop_engines.adapters.vllm`: ``VLLMServer`` over vLLM's ``AsyncLLM`` (``[vllm]``);
* :mod:`~agentloop_engines.adapters.sglang`: ``SGLangServer`` over ``sglang.Engine`` (``[sglang]``);
* shared: :mod:`~agentloop_engines.adapters.dtypes` (the dtype a checkpoint runs in),
  :mod:`~agentloop_engines.adapters.placeholders` (the image/video placeholder ban) and
  :mod:`~agentloop_engines.adapters.weight_check` (a weight update checked before any of it loads).

Nothing is imported here, so reaching one adapter never imports another's dependencies.
"""
