"""The training run behind train.py: ``config`` (its settings and recipes), ``setup`` (what a run
is built from), ``loop`` (``train_one_epoch``, ``evaluate`` and the run around them), ``model``,
``mixup`` and ``ema``; ``resume``, ``checkpoint`` and ``upload`` (never lose a run); ``metrics``,
``trackers``, ``progress``, ``keys_log`` and ``data_health`` (what a run reports)."""
