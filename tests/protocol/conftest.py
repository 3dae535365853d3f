"""The `fam` fixture behind support.verify_cpu.over_families: a fresh family per test (its params
are set per test), from the family name the mark passes indirectly."""

import pytest
from support.verify_cpu import FAMILIES


@pytest.fixture
def fam(request):
    return FAMILIES[request.param]()
