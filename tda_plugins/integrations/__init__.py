"""Framework adapters (transformers/TRL, OLMo-core), installed as ``tda_plugins.integrations``.

They import the engine; the engine never imports them.
"""
