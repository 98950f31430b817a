"""`rolefleet tiny-model`, `export` and `import-gguf`: model directories written, which load the model
libraries (transformers, peft)."""

from __future__ import annotations

import sys
from pathlib import Path

from rolefleet.app.tiny_model import make_tiny_model
from rolefleet.common.config import ConfigError
from rolefleet.export import ExportError, export_checkpoint
from rolefleet.gguf_import import import_gguf


def cmd_tiny_model(args) -> int:
    try:
        Path(args.out).mkdir(parents=True, exist_ok=True)  # before the warm start, not after it
        path = make_tiny_model(args.out, task=args.task, warm_start_steps=args.warm_start_steps, shape=args.shape,
                               hidden=args.hidden, layers=args.layers, seed=args.seed)
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"tiny-model: cannot write {args.out}: {e.strerror or e}") from None
    print(path)
    return 0


def cmd_export(args) -> int:
    try:
        path = export_checkpoint(Path(args.checkpoint), Path(args.out), args.dtype, args.base,
                                 Path(args.adapter_out) if args.adapter_out else None)
    except ExportError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:  # an unreadable checkpoint or an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"export: {e}") from None
    print(path)
    return 0


def cmd_import_gguf(args) -> int:
    try:
        done = import_gguf(Path(args.file), Path(args.out), args.dtype)
    except ExportError as e:  # GgufImportError, and an OUT that must not be written
        raise ConfigError(str(e)) from None
    except OSError as e:  # an unwritable OUT is the user's argument, not a crash
        raise ConfigError(f"import-gguf: {e}") from None
    for note in done.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"{done.out}: {done.architecture}, {done.parameters / 1e6:.1f}M parameters, eos {done.eos_token!r}, "
          f"responses stop at ids {list(done.stop_ids)}", file=sys.stderr)
    print(done.out)
    return 0
