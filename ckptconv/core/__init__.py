"""The bottom layer: errors, settings, URIs, job records, API keys, webhook signatures.

Nothing here imports torch, h5py or fastapi; every other layer may import it.
"""
