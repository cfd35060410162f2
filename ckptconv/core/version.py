"""The ckptconv version, recorded in manifests and reported by the API and the command line.

Kept in the lowest layer so that any module can read it without importing the ``ckptconv``
package's API (which reaches into the engine).
"""

__version__ = "0.1.0"
