"""Model layouts: converting checkpoints and configs between Hugging Face and Cerebras Model Zoo.

Each model family is a data table (``families/*.yaml``): key patterns with placeholders, tensor
transforms, config field mappings. A conversion is a path through the release graph
(``upgrades``), planned before any data moves and executed by the engine. Modules, bottom up:

- ``expr``, ``rules``, ``transforms``, ``config`` (config field hooks), ``registry`` (the tables),
  ``upgrades`` (the release graph, format names), ``folding``, ``sparsity``;
- ``views`` (a checkpoint under other key names), ``planner`` (one family's plan);
- ``composite`` (parts planned by their families), ``dpo`` (a wrapper), ``dpr``, ``llava``
  (composites), ``models`` (which planner a model name goes to);
- ``config_files`` (reading config files), ``api``: the entry points :func:`~.api.plan_model`,
  :func:`~.api.convert_model`, :func:`~.api.convert_config`, and ``registry.list_models``.

Importing this package imports nothing; ``registry`` and ``upgrades`` are torch-free.
"""
