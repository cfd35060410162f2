"""Model layouts: converting checkpoints and configs between Hugging Face and Cerebras Model Zoo.

Each model family is a data table (``families/*.yaml``): key patterns with placeholders, tensor
transforms, config field mappings; a model made of other families' models (``dpr``, ``llava``) or
wrapping one (``dpo``) is a table too, of kind composite or wrapper. A conversion is a path
through the release graph (``upgrades``), planned before any data moves and executed by the
engine. Modules, bottom up:

- ``expr``, ``rules``, ``transforms``, ``config`` (config conversion), ``hooks`` (config hooks
  several families share; one family's sit beside its table in ``families/<name>.py``),
  ``table_merge``, ``family`` (a family and its variants), ``tables`` (loading the tables),
  ``registry`` (model names -> tables), ``model_formats`` (format names), ``release_edges``
  (key renames and config steps per release), ``upgrades`` (the release graph),
  ``folding``, ``sparsity``;
- ``views`` (a checkpoint under other key names), ``planner`` (one family's plan);
- ``composite`` (parts planned by their families), ``families/dpo.py`` (a wrapper's planner),
  ``families/dpr.py``, ``families/llava.py`` (composites' planners), ``models`` (which planner a
  model name goes to);
- ``config_files`` (reading config files), ``api``: the entry points :func:`~.api.plan_model`,
  :func:`~.api.convert_model`, :func:`~.api.convert_config`, and ``registry.list_models``.

Importing this package imports nothing; ``registry`` and ``upgrades`` are torch-free.
"""
