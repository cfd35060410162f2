"""The engine: plan and run conversions (containers and model layouts), the simulator, legacy tools.

It reads and writes checkpoints only through :mod:`ckptconv.formats` and storage only through
:mod:`ckptconv.storage`.
"""
