"""`rolefleet status` and `scale`: calls to a running run's coordinator, over gRPC or its HTTP control
plane, with the operator's token and certificates."""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

from rolefleet.common.config import SecuritySection, TlsSection
from rolefleet.common.errors import RoleFleetError
from rolefleet.coordinator.client import run_status
from rolefleet.coordinator.state import RunState
from rolefleet.rpc.roles import use_security
from rolefleet.rpc.run_files import read_endpoints, run_token_file
from rolefleet.rpc.security import Security

UNAUTHENTICATED_HINT = ("the run refuses calls without its token: `rolefleet up` made one in <run.output_dir>/token "
                        "(--run DIR presents it); or pass --token-file FILE, or set ROLEFLEET_TOKEN")


def operator_security(args):
    """What the CLI presents to a run: the token of `--token-file`, else of the run `--run DIR`
    names (the one `rolefleet up` made there), else of ROLEFLEET_TOKEN; and with `--certs DIR` (what
    `rolefleet certs` wrote) TLS: the run's CA and the `client` certificate."""
    certs = args.certs
    tls = TlsSection(cert_file=f"{certs}/client.pem", key_file=f"{certs}/client-key.pem",
                     ca_file=f"{certs}/ca.pem") if certs else TlsSection()
    token_file = args.token_file or (args.run and run_token_file(Path(args.run)))
    return Security.of(SecuritySection(tls=tls, token_file=str(token_file) if token_file else None), "client")


def where_to_ask(args) -> None:
    """Without --address / --http, the coordinator of the run `--run DIR` names: its gRPC address
    (`status`) or its control plane (`scale`)."""
    wants_grpc = hasattr(args, "address")
    if (wants_grpc and args.address) or args.http:
        return
    if not args.run:
        raise ValueError("say which run: --run DIR (its run.output_dir)"
                         + (", --address HOST:PORT" if wants_grpc else "") + " or --http URL")
    endpoints = read_endpoints(Path(args.run))
    if wants_grpc:
        args.address = endpoints["address"]
        return
    args.http = endpoints["http"]
    if not args.http:
        raise ValueError(f"the run in {args.run} has no HTTP control plane (coordinator.http_enabled=false)")


def _explained(error: Exception) -> str:
    """The error, and how to present the token when the run refused the call for want of it."""
    refused = (isinstance(error, urllib.error.HTTPError) and error.code == 401) or \
        str(error).startswith("UNAUTHENTICATED")
    return f"{error}; {UNAUTHENTICATED_HINT}" if refused else str(error)


def http_call(url: str, security, certs: str | None, body: dict | None = None):
    """GET `url` (POST `body` as JSON) with the operator's token and `--certs`; the JSON answer."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if security.token:
        headers["Authorization"] = f"Bearer {security.token}"
    context = None
    if certs:
        context = ssl.create_default_context(cafile=f"{certs}/ca.pem")
        context.load_cert_chain(f"{certs}/client.pem", f"{certs}/client-key.pem")  # for mutual TLS
    request = urllib.request.Request(url, method="GET" if body is None else "POST", headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=30, context=context) as reply:
        return json.load(reply)


def cmd_status(args) -> int:
    try:
        where_to_ask(args)
        security = operator_security(args)
        use_security(security)  # a run with a token or TLS answers only to calls that present them
        status, roles = (_http_status(args.http, security, args.certs) if args.http
                         else asyncio.run(_grpc_status(args.address)))
    except (RoleFleetError, OSError, ValueError) as e:  # no coordinator there (yet, or any more)
        print(f"rolefleet: no run status from {args.http or args.address or args.run}: {_explained(e)}",
              file=sys.stderr)
        return 1
    print(f"run {status['run_name']}: {status['state']}, step {status['step']}/{status['total_steps']}, "
          f"policy version {status['policy_version']}, last mean reward {status['last_reward_mean']:.3f}"
          + (f", error: {status['error']}" if status["error"] else ""))
    for r in roles:
        if r.get("workers") is None:
            print(f"  {r['role']:<7} {r['address']:<21} not answering ({r['error']})")
            continue
        gpus = "no GPU" if r["devices"] == "" else f"CUDA_VISIBLE_DEVICES={r['devices']}"
        print(f"  {r['role']:<7} {r['address']:<21} {gpus}, {r['workers']} worker{'s' if r['workers'] != 1 else ''}"
              + (f", version {r['model_version']}, last step {r['last_step']}" if r["role"] in ("actor", "critic") else "")
              + (f", rollout engine {r['engine']}" if r.get("engine") else "")
              + (f", broken: {r['broken']}" if r["broken"] else "")
              + (f", health {r['health']}" if r.get("health", "SERVING") != "SERVING" else ""))
    return 0


async def _grpc_status(address: str) -> tuple[dict, list[dict]]:
    s = await run_status(address)
    status = {"run_name": s.run_name, "state": RunState(s.state).name, "step": s.step, "total_steps": s.total_steps,
              "policy_version": s.policy_version, "last_reward_mean": s.last_reward_mean, "error": s.error}
    roles = []
    for view in s.roles:
        if view.HasField("status"):
            r = view.status
            roles.append({"role": r.role, "address": view.address, "devices": r.devices, "workers": r.workers,
                          "model_version": r.model_version, "last_step": r.last_step, "broken": r.broken,
                          "engine": r.engine})
        else:
            roles.append({"role": view.error.split(":", 1)[0], "address": view.address, "error": view.error})
    return status, roles


def _http_status(url: str, security, certs: str | None) -> tuple[dict, list[dict]]:
    """The same view from the HTTP control plane (`/v1/status`, `/v1/roles`)."""
    return tuple(http_call(url.rstrip("/") + path, security, certs) for path in ("/v1/status", "/v1/roles"))


def cmd_scale(args) -> int:
    """Add or remove a reward replica of a running run, through its HTTP control plane."""
    change, address = ("add", args.add) if args.add else ("remove", args.remove)
    try:
        where_to_ask(args)
        replicas = http_call(f"{args.http.rstrip('/')}/v1/reward/replicas/{change}", operator_security(args),
                             args.certs, {"address": address})["replicas"]
    except urllib.error.HTTPError as e:  # the control plane's JSON error says why
        reason = json.load(e).get("error", e.reason)
        print(f"rolefleet: {reason}" + (f"; {UNAUTHENTICATED_HINT}" if e.code == 401 else ""), file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"rolefleet: no answer from {args.http or args.run}: {e}", file=sys.stderr)
        return 1
    print(f"reward replicas in use: {', '.join(replicas)}")
    return 0
