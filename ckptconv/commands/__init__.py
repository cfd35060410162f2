"""Subcommand modules of the ckptconv command line."""
