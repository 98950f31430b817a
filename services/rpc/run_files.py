"""What a run's output directory tells an operator's `rolefleet status --run DIR` / `scale --run DIR`:
the token `rolefleet up` made for the run, and where its coordinator answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

RUN_TOKEN_FILE = "token"               # written by `rolefleet up` (rpc/auth.py write_run_token)
ENDPOINTS_FILE = "coordinator.json"    # written by the coordinator once it serves


def write_endpoints(out: Path, address: str, http_url: Optional[str]) -> None:
    """Publish the coordinator's gRPC address and control-plane URL, atomically."""
    tmp = out / f".{ENDPOINTS_FILE}.tmp"
    tmp.write_text(json.dumps({"address": address, "http": http_url}))
    tmp.replace(out / ENDPOINTS_FILE)


def read_endpoints(run_dir: Path) -> dict:
    """{"address": ..., "http": ... or None}; ValueError naming the file when there is none yet."""
    path = run_dir / ENDPOINTS_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: no coordinator of a run in {run_dir} has started "
                         "(or --run names another directory than the run's run.output_dir)") from None
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not the coordinator's endpoints file") from None


def run_token_file(run_dir: Path) -> Optional[Path]:
    """The token `rolefleet up` made for the run in `run_dir`, if it made one."""
    path = run_dir / RUN_TOKEN_FILE
    return path if path.is_file() else None
