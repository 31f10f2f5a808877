"""Benchmarks behind ``infer/bench.py``: one module per subcommand, each exposing
``add_arguments(parser)`` and ``main(args)``.  They print ratios measured side by side in one run
(a readable table plus JSON); nothing in ``decoding/`` or ``training/`` imports them."""
