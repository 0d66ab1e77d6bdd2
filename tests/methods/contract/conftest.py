"""The shared contract checks what each method computes, with the kernels dispatched as a CPU run
dispatches them (torch or the C kernels), not through Triton's interpreter (tests/conftest.py
turns it on for the kernels' own tests, which compare each Triton kernel with its reference:
tests/methods/kernels, and test_quest.py, test_kivi.py, test_kvquant.py beside this folder).
Interpreted, Quest's page kernel and KVQuant's decode made these checks about a minute slower on
two cores."""

import pytest


@pytest.fixture(autouse=True)
def cpu_dispatch(torch_path):
    """tests/conftest.py's `torch_path`, for every contract test."""
