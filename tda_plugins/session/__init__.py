"""Sessions that record per-example gradients: one training run into a store
(``capture.py``, driven by the trainer integrations), a dataset outside training
(``dataset.py``, what ``tda capture`` runs), one batch in memory (``batch.py``), and the
settings they share (``settings.py``: layers, store, run)."""
