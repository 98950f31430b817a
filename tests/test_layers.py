"""The layer contract (docs/architecture.md, "Layers"), read from the source: every run-time import of
every module, at any depth (a function-level import hides a dependency, it does not remove it)."""

import ast
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parents[1] / "services"
ROLES = ("actor", "critic", "reward")
SERVERS = {"rolefleet.rpc.server", "rolefleet.serve", "rolefleet.up",
           *(f"rolefleet.{r}.server" for r in (*ROLES, "coordinator"))}
CORES = {f"rolefleet.{r}.core" for r in ROLES}


def module_name(path: Path) -> str:
    parts = path.relative_to(SERVICES).with_suffix("").parts
    return ".".join(["rolefleet", *parts]).removesuffix(".__init__")


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (annotations only: an in-process client names
    the core it wraps without importing it)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def imports(path: Path) -> set[str]:
    """Every module `path` imports at run time; `from X import Y` counts as X and as X.Y (Y may be a
    module)."""
    found = set()
    package = module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path)
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


MODULES = {module_name(p): imports(p) for p in SERVICES.rglob("*.py") if "pb" not in p.relative_to(SERVICES).parts}


def offenders(selected, forbidden) -> dict[str, list[str]]:
    bad = {}
    for module, found in MODULES.items():
        if selected(module):
            hits = sorted(name for name in found if forbidden(name))
            if hits:
                bad[module] = hits
    return bad


def under(*prefixes: str):
    return lambda name: any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_source_is_read():
    assert len(MODULES) > 80 and "rolefleet.actor.core" in MODULES
    assert "rolefleet.common.role_types" in MODULES["rolefleet.actor.core"]


def test_the_rl_maths_imports_nothing_of_the_system():
    """algos/ is pure maths over tensors: torch and the standard library, never a role or RPC."""
    assert offenders(under("rolefleet.algos"),
                     lambda n: n.startswith("rolefleet.") and not under("rolefleet.algos")(n)) == {}
    assert offenders(under("rolefleet.algos"), under("grpc", "transformers")) == {}


@pytest.mark.parametrize("client", ["rolefleet.rpc.roles", "rolefleet.rpc.channels",
                                    *(f"rolefleet.{r}.client" for r in (*ROLES, "coordinator"))])
def test_clients_never_import_servers_or_cores(client):
    assert client in MODULES
    assert offenders(lambda m: m == client, lambda n: n in SERVERS or n in CORES) == {}


def test_result_and_message_types_import_no_rpc_machinery():
    """types.py and role_types.py are what cores, servers and clients share: plain data."""
    def shared(module: str) -> bool:
        return module.endswith(".types") or module == "rolefleet.common.role_types"

    def rpc(name: str) -> bool:
        return (name in SERVERS or name in CORES or name.endswith(".client") or name == "rolefleet.rpc.roles"
                or under("grpc")(name))

    assert offenders(shared, rpc) == {}


def test_the_coordinator_holds_no_model_and_no_role_core():
    assert offenders(under("rolefleet.coordinator"), lambda n: n in CORES or under("transformers")(n)) == {}


def test_the_config_reaches_tasks_and_rewards_only_through_app_checks():
    """common/config/ sits below the roles and tasks: it imports the algorithm registries and itself;
    the validators that need the task and reward-function registries import them in app_checks.py."""
    config = under("rolefleet.common.config")
    assert "rolefleet.common.config.app_checks" in MODULES
    assert offenders(lambda m: config(m) and m != "rolefleet.common.config.app_checks",
                     lambda n: n.startswith("rolefleet.") and not under("rolefleet.algos")(n) and not config(n)) == {}
    assert offenders(lambda m: m == "rolefleet.common.config.app_checks",
                     lambda n: n.startswith("rolefleet.") and not config(n)
                     and not under("rolefleet.tasks", "rolefleet.reward.functions")(n)) == {}


APPS = ("rolefleet.actor", "rolefleet.critic", "rolefleet.reward", "rolefleet.coordinator", "rolefleet.tasks",
        "rolefleet.deploy", "rolefleet.serve", "rolefleet.up", "rolefleet.cli", "rolefleet.export",
        "rolefleet.gguf_import", "rolefleet.app")


def test_common_imports_no_other_layer():
    """common/ is the bottom: wire format, result and error types, config, model loading."""
    assert offenders(lambda m: under("rolefleet.common")(m) and m != "rolefleet.common.config.app_checks",
                     under("rolefleet.rpc", "rolefleet.trainer", *APPS)) == {}


def test_the_training_engine_knows_no_rpc_and_no_role():
    """trainer/ (workers, ranks, the trainer, the controller base) is below the roles and beside
    RPC: a role's server wraps it, it never calls out."""
    assert offenders(under("rolefleet.trainer"), under("rolefleet.rpc", "grpc", *APPS)) == {}


def test_rpc_knows_no_training_engine_and_no_role():
    assert offenders(under("rolefleet.rpc"), under("rolefleet.trainer", *APPS)) == {}


def test_workers_are_driven_by_reference_never_by_name():
    """Every call into a role's workers names a @collective method (`Workers.run(Worker.method)`);
    nothing dispatches on a method name's string."""
    source = "\n".join(p.read_text() for p in SERVICES.rglob("*.py") if "pb" not in p.parts)
    assert "spmd(" not in source and "getattr(core, name)" not in source
