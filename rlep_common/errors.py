"""`UserError`: a mistake the user can fix, raised at whatever layer finds it.

It lives here, at the bottom, so a service, the launcher or a command can raise it without importing the
command line. The `rlep` command (`rlep.services.cli.errors.RlepGroup`) prints it as `error: <message>` and
exits 2 with no traceback. A URL in the message has its password masked (`redact_urls`): messages quote the
address they tried, and a Redis URL carries its password.
"""

from __future__ import annotations

from rlep.common.redaction import redact_urls


class UserError(Exception):
    """A mistake the user can fix; the message names the problem and the fix, in one or two lines."""

    def __init__(self, message: str):
        super().__init__(redact_urls(message))
