"""OpenAI-compatible serving of one long-lived speculative decoder.

``protocol`` parses and bounds request bodies, ``textstream`` detokenizes incrementally and cuts at
stop strings, ``scheduler`` owns the decoder in a background thread (continuous batching),
``metrics`` keeps the Prometheus counters, ``app`` is the HTTP layer and ``server`` loads models and
runs uvicorn (``infer/serve.py`` is its CLI).
"""
