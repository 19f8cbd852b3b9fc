"""Integrations of pagedattn with other libraries.

Each submodule imports its library lazily, so importing ``pagedattn.integrations`` needs nothing beyond pagedattn.
"""
