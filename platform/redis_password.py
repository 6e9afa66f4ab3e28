"""Where the Redis password lives: in the environment of the processes that use it, never in a
file longrun writes or a message it sends.

A `cluster.redis_url` may spell its password out (`redis://:PW@host:6379/0`, or
`?password=PW`), or name the reference `${LONGRUN_REDIS_PASSWORD}` in its place. Whatever
longrun writes down (the resolved config next to the checkpoints, the config shipped with a
submitted job, its fingerprint) holds the reference (`as_reference`); loading such a config
puts the password back (`resolve`) from $LONGRUN_REDIS_PASSWORD, or from the file named by
$LONGRUN_REDIS_PASSWORD_FILE, which must be readable by its owner only (mode 0600). So a
submitted job runs with the password of the cluster it lands on (KubeRay: a Secret; compose:
deploy/.env), and the submitter's never leaves their machine.

A placeholder (deploy/.env.example's `change-me`, and the like) is refused wherever it is met.

A password written into the user-info without percent-encoding (`redis://:Zk3/Qp9+x@host`, as
`openssl rand -base64` makes one) is read as running to the URL's last '@' (`normalised`): URL
parsers stop at its first '/', '?' or '#', so redis-py could not connect and, worse, nothing
found a password to hide, leaving the URL whole in every file and message.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from longrun.redact import PASSWORD_ENV

PASSWORD_FILE_ENV = "LONGRUN_REDIS_PASSWORD_FILE"
REFERENCE = "${" + PASSWORD_ENV + "}"
REDIS_SCHEMES = ("redis://", "rediss://")  # what every longrun client can reach over TCP
PLACEHOLDERS = frozenset({"change-me", "changeme", "change_me", "password", "secret", "redis",
                          "placeholder", "example", "xxx", "***"})


class RedisPasswordError(ValueError):
    """The password is missing, unreadable, exposed or a placeholder; the message says what to do."""


def _parts(url: str):
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    return parts, query


def normalised(url: str) -> str:
    """`url` with a user-info written without percent-encoding encoded. The user-info is what
    lies between '://' and the URL's last '@'; `url` itself when a parser already finds it whole
    (or it has none, or the '@' belongs to a ?password= value)."""
    head, sep, tail = url.partition("://")
    if not sep or "@" not in tail:
        return url
    parts, query = _parts(url)
    if "@" in parts.netloc or any(k == "password" for k, _ in query):
        return url
    info, _, rest = tail.rpartition("@")
    user, colon, password = info.partition(":")
    return f"{head}{sep}{quote(user, safe='')}{colon}{quote(password, safe='${}')}@{rest}"


def password_of(url: str | None) -> str | None:
    """The password `url` spells out or refers to (user-info first, then ?password=), unquoted."""
    if url is None:
        return None
    parts, query = _parts(normalised(url))
    if parts.password is not None:
        return unquote(parts.password)
    return next((v for k, v in query if k == "password"), None)


def _with_password(url: str, password: str) -> str:
    """`url` with its password (user-info or query) replaced by `password`, quoted for a URL."""
    url = normalised(url)
    parts, query = _parts(url)
    if parts.password is not None:
        user, host = parts.netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}:{quote(password, safe='${}')}@{host}"
        return urlunsplit(parts._replace(netloc=netloc))
    query = urlencode([(k, password if k == "password" else v) for k, v in query], safe="${}/")
    return urlunsplit(parts._replace(query=query))


def as_reference(url: str | None) -> str | None:
    """`url` with its password replaced by the reference: what a written file may hold."""
    if password_of(url) is None:
        return url
    return _with_password(url, REFERENCE)


def is_reference(url: str | None) -> bool:
    return password_of(url) == REFERENCE


def refuse_placeholder(password: str, where: str) -> None:
    """RedisPasswordError when `password` is a placeholder (an example's, or a masked one)."""
    if password.strip().lower() in PLACEHOLDERS:
        raise RedisPasswordError(
            f"the Redis password in {where} is the placeholder {password!r}; set a real one (e.g. "
            "`openssl rand -hex 24`: nothing in it needs quoting in a URL) there and in the Redis "
            "server's requirepass")


def read_password(env: Mapping[str, str] | None = None) -> str | None:
    """The password from $LONGRUN_REDIS_PASSWORD, else from the 0600 file $LONGRUN_REDIS_PASSWORD_FILE
    names; None when neither is set."""
    env = os.environ if env is None else env
    if password := env.get(PASSWORD_ENV):
        refuse_placeholder(password, f"${PASSWORD_ENV}")
        return password
    if not (name := env.get(PASSWORD_FILE_ENV)):
        return None
    path = Path(name)
    try:
        mode = path.stat().st_mode
        password = path.read_text().strip()
    except OSError as exc:
        raise RedisPasswordError(f"cannot read the Redis password from {path} (${PASSWORD_FILE_ENV}): "
                                 f"{exc.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RedisPasswordError(f"{path} (${PASSWORD_FILE_ENV}) holds the Redis password but others "
                                 f"can read it (mode {stat.S_IMODE(mode):o}); run `chmod 600 {path}`")
    refuse_placeholder(password, str(path))
    return password


def resolve(url: str | None, env: Mapping[str, str] | None = None, *, strict: bool = True) -> str | None:
    """`url` with a reference replaced by the password from the environment. Without one there:
    RedisPasswordError when `strict`, else `url` unchanged (a worker's copy of the config, say).
    A password written without percent-encoding comes back encoded (`normalised`)."""
    if url is None:
        return None
    url = normalised(url)
    if not is_reference(url):
        return url
    password = read_password(env)
    if password is None:
        if not strict:
            return url
        raise RedisPasswordError(
            f"the Redis URL refers to {REFERENCE}, and neither ${PASSWORD_ENV} nor "
            f"${PASSWORD_FILE_ENV} (a file of mode 0600) is set here: set one in the environment "
            "of this process (on a cluster: of its nodes, e.g. from a Kubernetes Secret)")
    return _with_password(url, password)
