"""URL passwords masked wherever a URL reaches a message: one URL, URLs inside a text, a `UserError`."""

import pytest

from rlep.common.errors import UserError
from rlep.common.redaction import redact_urls


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            "cannot reach the Redis at redis://:pw@h:6379/0 (refused); fix redis_url",
            "cannot reach the Redis at redis://:***@h:6379/0 (refused); fix redis_url",
        ),
        (
            "scorer 'https://u:p%40ss@rm:8443/score?token=t1' failed",
            "scorer 'https://u:***@rm:8443/score?token=***' failed",
        ),
        ("two: redis://:a@h/0 and http://b:c@i/", "two: redis://:***@h/0 and http://b:***@i/"),
        ("no secret: redis://h:6379/0, http://user@h/", "no secret: redis://h:6379/0, http://user@h/"),
        ("not a url @ all", "not a url @ all"),
    ],
)
def test_every_url_in_a_text_has_its_password_masked(text, shown):
    assert redact_urls(text) == shown


def test_a_user_error_never_holds_a_url_password():
    assert str(UserError("cannot reach the Redis at redis://:hunter2@h/0; start it")) == (
        "cannot reach the Redis at redis://:***@h/0; start it"
    )
