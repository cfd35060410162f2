"""Conformance suites that ship with ckptconv, for its own tests and for anyone adding a backend or
a format: :class:`~ckptconv.testing.storage_tests.StorageTests` and
:class:`~ckptconv.testing.format_tests.FormatTests`.

Test code only: these modules import pytest, and nothing in ckptconv imports them at run time
(import-linter keeps it so).
"""
