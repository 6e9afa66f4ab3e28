"""`redact`: the one function every message, event, record field and log line that could carry
a credential goes through before it is shown or stored.

A Redis URL carries its password in one of two places, and both are masked wherever a URL
appears inside the text: the user-info (`redis://:PW@host`, `rediss://user:PW@host`, any
scheme) and the query (`?password=PW`, `&password=PW`). In the user-info, everything from the
first ':' to the LAST '@' of the URL is masked: a password written without percent-encoding may
hold '/', '?', '#' and '@' (`openssl rand -base64` writes '/' in about 4 of 10), and a parser
that stops at the first of them would leave the rest of it in the clear. Passwords a caller knows (the one in
$LONGRUN_REDIS_PASSWORD, always) are masked wherever they appear, raw or URL-quoted: a server's
error message may echo one outside any URL.
"""

from __future__ import annotations

import os
import re
from urllib.parse import quote

MASK = "***"
PASSWORD_ENV = "LONGRUN_REDIS_PASSWORD"
# Shorter known secrets are masked only inside URLs: masking every "ab" of a message would
# garble it (and a password that short protects nothing).
_MIN_LITERAL = 4

# scheme://user:password@ - the password runs to the last '@' of the URL (greedy, no space).
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:@/?#]*:)(?P<pw>\S*)@")
_QUERY = re.compile(r"(?P<head>[?&;]password=)(?P<pw>[^&#\s'\"]*)", re.IGNORECASE)


def redact(text: str, *known: str | None) -> str:
    """`text` with every password masked: those of URLs in it, `known` ones and $LONGRUN_REDIS_PASSWORD."""
    text = _USERINFO.sub(lambda m: f"{m['head']}{MASK}@" if m["pw"] else m[0], text)
    text = _QUERY.sub(lambda m: f"{m['head']}{MASK}" if m["pw"] else m[0], text)
    for secret in {*known, os.environ.get(PASSWORD_ENV)}:
        if secret and len(secret) >= _MIN_LITERAL and secret != MASK:
            for form in {secret, quote(secret, safe=""), quote(secret)}:
                text = text.replace(form, MASK)
    return text
