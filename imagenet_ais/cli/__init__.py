"""The command lines, thin click front ends over the package: ``train`` (train.py), ``shards``
(imagenet_shards.py), ``plot``, ``upload`` (upload.sh) and ``torchrun`` (./run's torchrun)."""
