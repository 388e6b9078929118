"""Torch-free engine core: requests, paged-KV block manager, continuous-batching scheduler."""
