"""Reward sources: where a score comes from, behind one interface.

A source scores a list of items and returns one Outcome per item: a float score, or a str saying why
it has none (the core then counts `reward.fallback_score` for it). Kinds:
- a built-in function, called in the server (`FunctionSource`), or in the worker processes when it
  is marked isolated (`math`: sympy can spin on an answer for ever);
- a user function from a Python file, always in the worker processes (`PooledSource`);
- a reward model (`ModelSource`; transformers and the model load only when one is configured).
"""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Protocol

from rolefleet.common.config import ConfigError, RewardSection
from rolefleet.common.model_paths import model_problem
from rolefleet.reward.functions import REWARD_FUNCTIONS, isolated_target
from rolefleet.reward.sandbox import LoadError, SandboxPool, Target, WorkerFailed
from rolefleet.reward.sandbox_worker import Outcome, as_score, one_line
from rolefleet.reward.types import ScoreItem

log = logging.getLogger(__name__)


class Source(Protocol):
    name: str
    weight: float

    def score(self, items: list[ScoreItem]) -> list[Outcome]: ...
    def close(self) -> None: ...


def _raised(exc: BaseException) -> str:
    return one_line(f"raised {type(exc).__name__}: {exc}")


class FunctionSource:
    """A built-in function run in the server thread: fast, and trusted not to hang."""

    def __init__(self, name: str, weight: float, fn: Callable[..., Any], options: dict[str, Any]):
        self.name, self.weight, self.fn, self.options = name, weight, fn, options

    def score(self, items: list[ScoreItem]) -> list[Outcome]:
        return [self._one(item) for item in items]

    def _one(self, item: ScoreItem) -> Outcome:
        try:
            return as_score(self.fn(item.prompt, item.response, item.ground_truth, item.extra, **self.options))
        except Exception as exc:  # noqa: BLE001 - the function's failure is this sample's outcome
            return _raised(exc)

    def close(self) -> None:
        pass


class PooledSource:
    """A function run in the worker processes (user files, isolated built-ins)."""

    def __init__(self, name: str, weight: float, pool: SandboxPool, batched: bool):
        self.name, self.weight, self.pool, self.batched = name, weight, pool, batched

    def score(self, items: list[ScoreItem]) -> list[Outcome]:
        return self.pool.run(self.name, items, self.batched)

    def close(self) -> None:
        pass  # the pool is shared: the core closes it


class ModelSource:
    """A reward model's scalar output (rolefleet.reward.model, imported only for this kind)."""

    def __init__(self, name: str, weight: float, path: str, dtype: str, max_tokens_per_batch: int):
        # Only for a model source: they load transformers, which a reward of functions never needs.
        from rolefleet.common.modeling import pick_device
        from rolefleet.reward.model import RewardModelScorer  # as above

        self.name, self.weight = name, weight
        self.scorer = RewardModelScorer(path, dtype, max_tokens_per_batch, pick_device())

    def score(self, items: list[ScoreItem]) -> list[Outcome]:
        try:
            return [as_score(v) for v in self.scorer.score(items).tolist()]
        except Exception as exc:  # noqa: BLE001 - becomes the samples' outcome
            if len(items) == 1:
                return [_raised(exc)]
            # One sample the model cannot take (nothing to tokenize, say) must not cost the batch
            # its scores: find it by scoring one at a time.
            log.warning("reward model %s failed on a batch of %d (%s); scoring one by one", self.name,
                        len(items), _raised(exc))
            return [outcome for item in items for outcome in self.score([item])]

    def close(self) -> None:
        self.scorer.close()


def source_key(cfg: RewardSection, index: int, field: str) -> str:
    """The config key of a source's field, as errors name it."""
    return f"reward.sources[{index}].{field}" if cfg.sources else "reward.function"


def build_sources(cfg: RewardSection) -> tuple[list[Source], Optional[SandboxPool]]:
    """The configured sources, in order, and the worker pool they share (None when nothing runs in
    workers). Raises ConfigError naming the key of a source that cannot start."""
    specs = cfg.scoring_sources()
    pool = _start_pool(cfg, specs)
    sources: list[Source] = []
    try:
        for i, spec in enumerate(specs):
            sources.append(_build(cfg, i, spec, pool))
    except BaseException:
        for source in sources:
            source.close()
        if pool is not None:
            pool.close()
        raise
    return sources, pool


def _build(cfg: RewardSection, i: int, spec: RewardSection.Source, pool: Optional[SandboxPool]) -> Source:
    if spec.kind == "user" or (spec.kind == "function" and isolated_target(spec.function)):
        return PooledSource(spec.name, spec.weight, pool, spec.batched)
    if spec.kind == "model":
        try:
            return ModelSource(spec.name, spec.weight, spec.path, cfg.model_dtype, cfg.model_max_tokens_per_batch)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{source_key(cfg, i, 'path')}: {e}") from None
    source = FunctionSource(spec.name, spec.weight, REWARD_FUNCTIONS.get(spec.function), spec.options)
    # Options that only fail when used (a tokenizer that does not load) fail here, at start,
    # rather than as an error on every sample.
    if spec.options and isinstance(probe := source.score([ScoreItem("", "", "")])[0], str):
        raise ConfigError(f"{source_key(cfg, i, 'function')}: {spec.function} cannot score an empty sample "
                          f"with its options: {probe}")
    return source


def _start_pool(cfg: RewardSection, specs: list[RewardSection.Source]) -> Optional[SandboxPool]:
    targets, keys = {}, {}
    for i, spec in enumerate(specs):
        if spec.kind == "user":
            file, fn = spec.user_function()
            targets[spec.name] = Target("file", str(Path(file).resolve()), fn)
            keys[spec.name] = source_key(cfg, i, "path")
        elif spec.kind == "function" and (where := isolated_target(spec.function)):
            targets[spec.name] = Target("module", *where, spec.options)
            keys[spec.name] = source_key(cfg, i, "function")
    if not targets:
        return None
    try:
        return SandboxPool(targets, cfg.user_workers, cfg.user_timeout_s, cfg.user_memory_mb)
    except LoadError as e:
        raise ConfigError("cannot load reward functions:\n  " + "\n  ".join(
            f"{keys[name]}: {error}" for name, error in e.errors.items())) from None
    except WorkerFailed as e:
        raise ConfigError(f"reward.sources: {e} (reward.user_memory_mb={cfg.user_memory_mb})") from None


# --- preflight ----------------------------------------------------------------------------------

def check_sources(cfg: Any) -> list[str]:
    """Problems with the reward sources of `cfg` (a RoleFleetConfig or its RewardSection), found
    without running any of them: a user file that is missing, not Python, or defines no such
    function at its top level; a reward model that does not exist. One line each, naming the key."""
    reward: RewardSection = getattr(cfg, "reward", cfg)
    problems = []
    for i, spec in enumerate(reward.sources):
        if spec.kind == "user":
            file, fn = spec.user_function()
            if (problem := _user_file_problem(file, fn)) is not None:
                problems.append(f"reward.sources[{i}].path: {problem}")
        elif spec.kind == "model" and (problem := model_problem(spec.path)) is not None:
            problems.append(f"reward.sources[{i}].path: {problem}")
    if reward.env.path:  # a user environment: the same checks as a user reward function's file
        file, _, fn = reward.env.path.rpartition(":")
        if (problem := _user_file_problem(file, fn)) is not None:
            problems.append(f"reward.env.path: {problem}")
    return problems


def _user_file_problem(file: str, fn: str) -> Optional[str]:
    path = Path(file)
    if not path.is_file():
        return f"{file} {'is a directory' if path.is_dir() else 'does not exist'}"
    try:
        tree = ast.parse(path.read_bytes(), filename=file)
    except (OSError, ValueError) as e:
        return f"cannot read {file}: {e}"
    except SyntaxError as e:
        return f"{file} is not valid Python (line {e.lineno}: {e.msg})"
    defined = _top_level_names(tree)
    if isinstance(defined.get(fn), ast.AsyncFunctionDef):
        return f"{file}:{fn} is an async function; reward functions are called as plain functions"
    if fn not in defined and "*" not in defined:  # a star import may bring it: the workers will tell
        return f"{file} defines no {fn!r} at its top level"
    return None


def _top_level_names(tree: ast.Module) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        else:  # definitions under if/try/with: counted, whatever the branch taken
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names[inner.name] = inner
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names[inner.id] = inner
    return names
