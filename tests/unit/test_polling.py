"""tests/polling.py, the one polling loop every test folder's helpers call."""

import pytest

from polling import wait_until


def test_returns_the_first_truthy_value():
    values = iter([0, None, [], "ready"])
    assert wait_until(lambda: next(values), 5, 0) == "ready"


def test_times_out_naming_what_it_waited_for_and_the_last_value():
    with pytest.raises(pytest.fail.Exception, match=r"timed out after 0.1s waiting for the thing; last: \[\]"):
        wait_until(lambda: [], 0.1, 0.01, "the thing")


def test_retries_the_listed_errors_and_reports_the_last_with_the_diagnosis():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise AssertionError("kubectl failed")
        return "ok"

    assert wait_until(flaky, 5, 0, retry_on=(AssertionError,)) == "ok"

    def failing():
        raise AssertionError("kubectl failed")

    with pytest.raises(pytest.fail.Exception, match=r"(?s)kubectl failed.*kubectl describe: pending"):
        wait_until(failing, 0.05, 0.01, retry_on=(AssertionError,), diagnose=lambda: "kubectl describe: pending")


def test_other_errors_propagate_at_once():
    with pytest.raises(ZeroDivisionError):
        wait_until(lambda: 1 / 0, 5, 0)
