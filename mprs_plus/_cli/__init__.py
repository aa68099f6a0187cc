"""Subcommands of ``python -m mprs_plus``; each module has ``register(subparsers)``."""
