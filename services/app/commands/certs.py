"""`rolefleet certs`: a development CA and a certificate per role, with nothing else loaded (no torch:
the command answers at once)."""

from __future__ import annotations

from rolefleet.certs import CertsError, make_certs
from rolefleet.common.config import ConfigError


def cmd_certs(args) -> int:
    try:
        paths = make_certs(args.out, hosts=args.host, days=args.days, force=args.force)
    except CertsError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"certs: cannot write {args.out}: {e.strerror or e}") from None
    for path in paths:
        print(path)
    return 0
