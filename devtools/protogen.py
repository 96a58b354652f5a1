"""Generate the Python code for proto/rlgate/v1 with grpcio-tools (`make proto`).

`python -m rlgate.devtools.protogen OUT_DIR` writes `OUT_DIR/rlgate/v1/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py`.
The drift test runs it into a temporary directory and compares with the committed files.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "rlgate" / "v1").glob("*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return sorted((out_dir / "rlgate" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "clients" / "python")):
        print(path)
