"""Generate the gRPC/protobuf stubs (with .pyi) from protos/ into services/common/pb/.

The only way stubs are made; tests/common/test_protos.py fails when the committed stubs differ
from a fresh generation. Usage: python scripts/gen_protos.py [--out DIR]
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
PROTO_PACKAGE = "rolefleet/v1"
DEFAULT_OUT = ROOT / "services" / "common" / "pb"
# protoc writes imports after the proto package (rolefleet.v1); the stubs live in rolefleet.common.pb.
IMPORT_FROM = re.compile(r"^from rolefleet\.v1 import ", re.MULTILINE)
IMPORT_TO = "from rolefleet.common.pb import "
HEADER = '"""Generated gRPC/protobuf stubs. Do not edit: run `make proto`."""\n'


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency only

    protos = sorted((PROTO_ROOT / PROTO_PACKAGE).glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in protos],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        written = []
        for src in sorted((Path(tmp) / PROTO_PACKAGE).iterdir()):
            dst = out_dir / src.name
            dst.write_text(IMPORT_FROM.sub(IMPORT_TO, src.read_text()))
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text(HEADER)
    return [init, *written]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out.parent) if path.is_relative_to(args.out.parent) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
