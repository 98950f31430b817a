"""Path keys as a shell reads them: a leading `~` (the home directory) and environment variables
(`$NAME`, `${NAME}`) expanded while the config is validated, before any check opens the file, so
`data.path=~/data/gsm8k/train.parquet` from a verl guide works and the run's config.yaml holds the
paths its roles open. A hub id has neither and is left as it is, and so is `{role}` of the TLS and
token paths (a placeholder, not a variable). An unset variable is an error naming it: a path left
as `$DATA/train.parquet` would only fail later, as a missing file.
"""

from __future__ import annotations

import os
import re
from typing import Annotated

from pydantic import AfterValidator

# $NAME, or ${...} (its content checked below: an unclosed or empty brace is an error, not text).
_REFERENCE = re.compile(r"\$(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|\{(?P<braced>[^}]*)(?P<close>\}?))")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def expand_path(value: str) -> str:
    """`value` with a leading `~` or `~user` and every `$NAME` / `${NAME}` expanded. As in a shell,
    the home directory and a variable's value are not expanded again, and a `$` before anything
    else (`a$`, `$1`) is kept. Raises ValueError for an unset variable or a malformed `${`."""
    home, slash, rest = value.partition("/") if value.startswith("~") else ("", "", value)
    return os.path.expanduser(home) + slash + _REFERENCE.sub(_variable, rest)


def _variable(match: re.Match) -> str:
    name = match["name"]
    if name is None:
        name = match["braced"]
        if not match["close"] or not _NAME.fullmatch(name):
            raise ValueError(f"{match.group()!r} is not an environment variable: write $NAME or ${{NAME}}")
    if name not in os.environ:
        raise ValueError(f"environment variable {name} is not set")
    return os.environ[name]


# A path-valued key: a file, a directory, a model (local directory or hub id), file.py:function.
ExpandedPath = Annotated[str, AfterValidator(expand_path)]
