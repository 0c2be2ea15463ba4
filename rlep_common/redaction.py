"""Credentials out of what is shown: a URL's password (user-info or `?password=`) reads `***` wherever a URL
reaches a message, a log line or a printed config. `redact_url` masks one URL, `redact_urls` every URL in a text
(an error message that quotes an address); `config.redact_secrets` applies it to a whole config."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

MASK = "***"
# Query parameters that carry credentials in the URLs we take (redis-py reads `?password=`).
SECRET_QUERY_KEYS = ("password", "passwd", "token", "secret")
# A URL inside free text: a scheme, `://`, then everything up to white space or a closing quote or bracket.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()]+")


def redact_url(url: str) -> str:
    """`url` with its password masked; a text that does not parse as a URL is returned as it is."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL after all (e.g. a bad port): leave it
        return url
    if password:
        parts = parts._replace(netloc=f"{parts.username or ''}:{MASK}@{parts.netloc.rpartition('@')[2]}")
    if parts.query:
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        masked = [(k, MASK if any(s in k.lower() for s in SECRET_QUERY_KEYS) else v) for k, v in pairs]
        if masked != pairs:
            parts = parts._replace(query=urlencode(masked, safe="*"))
    return urlunsplit(parts)


def redact_urls(text: str) -> str:
    """`text` with every URL in it masked by `redact_url`."""
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text) if "://" in text else text
