"""The model tables, one YAML each, and the code a single table needs beside it.

- ``<family>.yaml``: a family's key rules and config mapping (kind ``family``); when its config
  conversion needs a step the table cannot say as data, ``<family>.py`` beside it holds that hook
  (shared hooks are in :mod:`ckptconv.engine.layouts.hooks`);
- ``<model>.yaml`` of kind ``composite`` (``dpr``, ``llava``) or ``wrapper`` (``dpo``): a model
  made of other families' models, with ``<model>.py`` beside it planning its conversions.

Importing this package registers the one-family hooks; the composite and wrapper planners are
imported by :mod:`ckptconv.engine.layouts.models`.
"""

from ckptconv.engine.layouts.families import bert, bloom, btlm, codegen, falcon, gemma2, gpt_neox, mpt, roberta, t5

# Each module registers its hook under the name its table lists (``config.hooks``).
HOOK_MODULES = (bert, bloom, btlm, codegen, falcon, gemma2, gpt_neox, mpt, roberta, t5)
