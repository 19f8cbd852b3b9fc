"""Shared fixtures: the suite tests the installed package, never the
sources next to it."""

import os
import pathlib

import pytest


@pytest.fixture(scope="session", autouse=True)
def installed_package():
    import pagedattn

    source = os.environ.get("PAGEDATTN_SOURCE_DIR")
    if source:
        here = pathlib.Path(pagedattn.__file__).resolve()
        assert pathlib.Path(source, "python").resolve() not in here.parents, (
            f"pagedattn was imported from the source tree ({here}); install it first (scripts/test does)")
    return pagedattn
