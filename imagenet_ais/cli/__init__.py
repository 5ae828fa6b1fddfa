"""The command lines, thin click front ends over the package: ``train`` (train.py), ``shards``
(imagenet_shards.py), ``plot`` and ``upload`` (upload.sh)."""
