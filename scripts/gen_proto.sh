#!/usr/bin/env bash
# Regenerate the gRPC stubs for deltaserve's API from deployments/proto/**/*.proto.
#
#   scripts/gen_proto.sh            # write next to the .proto files (commit the result)
#   scripts/gen_proto.sh OUT_DIR    # write into OUT_DIR instead (tests/deployments/test_proto.py)
#
# Uses grpc_tools.protoc from the interpreter in $PYTHON (default: the repo's .venv, else
# python3). The .proto keeps its canonical name (deltaserve/v1/inference.proto, package
# deltaserve.v1: what reflection reports and other languages compile), so protoc writes
# Python that assumes a top-level `deltaserve` package. Two rewrites make the stubs live in
# `deployments.proto.deltaserve.v1` instead:
#   * _pb2_grpc.py: `from deltaserve.v1 import inference_pb2` -> `from . import inference_pb2`;
#   * _pb2.py: the module name given to the message classes (their __module__), else
#     pickling a request (Ray Serve pickles it from the proxy to the replica) would look
#     for `deltaserve.v1.inference_pb2`, which does not exist.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROTO_ROOT="$ROOT/deployments/proto"
OUT="${1:-$PROTO_ROOT}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

PROTOS=(deltaserve/v1/inference.proto)

mkdir -p "$OUT"
cd "$PROTO_ROOT"
"$PYTHON" -m grpc_tools.protoc \
  --proto_path=. \
  --python_out="$OUT" \
  --pyi_out="$OUT" \
  --grpc_python_out="$OUT" \
  "${PROTOS[@]}"

for proto in "${PROTOS[@]}"; do
  stem="${proto%.proto}"                 # deltaserve/v1/inference
  pkg="$(dirname "$proto" | tr / .)"     # deltaserve.v1
  mod="$(basename "$stem")"              # inference
  grpc_file="$OUT/${stem}_pb2_grpc.py"
  pb2_file="$OUT/${stem}_pb2.py"
  sed -i.bak -e "s/'${pkg//./\\.}\.${mod}_pb2'/'deployments.proto.${pkg}.${mod}_pb2'/" "$pb2_file"
  rm -f "$pb2_file.bak"
  if ! grep -q "'deployments\.proto\.${pkg//./\\.}\.${mod}_pb2'" "$pb2_file"; then
    echo "gen_proto.sh: failed to rewrite the module name in $pb2_file" >&2
    exit 1
  fi
  # `from deltaserve.v1 import inference_pb2 as ...` -> `from . import inference_pb2 as ...`
  sed -i.bak -e "s/^from ${pkg//./\\.} import ${mod}_pb2 as /from . import ${mod}_pb2 as /" "$grpc_file"
  rm -f "$grpc_file.bak"
  if grep -q "^from ${pkg//./\\.} import" "$grpc_file"; then
    echo "gen_proto.sh: failed to rewrite the absolute import in $grpc_file" >&2
    exit 1
  fi
done
