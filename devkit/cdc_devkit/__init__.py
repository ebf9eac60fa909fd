"""The development kit: local servers, demo, chaos run, workload generator, oracle, checks.

Not part of the product: installed editable for development (``make venv``), never
copied into the service images. Its commands join ``cdc`` through the entry-point group
``cdc.commands``.
"""
