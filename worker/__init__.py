"""The conversion engine and the Celery worker that runs it.

Importing this package is cheap: heavy modules (torch, h5py) are imported by the
submodules that need them.
"""
