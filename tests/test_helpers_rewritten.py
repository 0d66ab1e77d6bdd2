"""The shared helpers assert on behalf of many tests: pytest rewrites them (tests/conftest.py),
so a failure there shows what differed instead of a bare AssertionError."""

import pytest

from tests.helpers.sweeps import assert_close


def test_a_helpers_failure_shows_its_values():
    with pytest.raises(AssertionError) as err:
        assert_close({"a": 1}, {"a": 2}, 0.0)
    assert "1 == 2" in str(err.value)
