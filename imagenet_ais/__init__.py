"""Train ImageNet-class models from WebDataset shards (local, AIStore, GCS)."""
