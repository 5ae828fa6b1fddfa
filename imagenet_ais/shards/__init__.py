"""The shard format and its tools: ``convert`` (an ImageFolder tree → verified tar shards and
``manifest.json``), ``verify``, ``synth`` (the demo's pictures), ``cache`` (the node's copies of
remote shards, and preload); ``manifest``, ``members`` (a shard's tar members) and ``inputs``
(reading the source tree) are the format; ``progress`` is the tools' progress bars."""
