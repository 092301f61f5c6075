#!/usr/bin/env bash
# Create (idempotently) the .venv-hf environment used to produce Hugging Face
# transformers reference logits for Kimi-Linear (scripts/hf_reference.py).
#
# - torch is pinned exactly: a CPU wheel of 2.13.0 lies on disk; a looser range
#   could pull a multi-GB CUDA build.
# - transformers is pinned exactly (5.24.0 is the first version the requirement
#   accepts and the newest one the index offers).
# - fla-core / flash-linear-attention (and causal-conv1d, flash-attn, kernels)
#   must NOT be present: transformers would pick their kernels instead of the
#   pure-torch Kimi-Linear path.
#
# Usage: scripts/hf_env.sh   (from anywhere; the venv lands in the repo root)
set -euo pipefail

TORCH_VERSION="2.13.0"
TRANSFORMERS_VERSION="5.24.0"
SAFETENSORS_SPEC="safetensors==0.8.0"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ROOT}/.venv-hf"
PY="${VENV}/bin/python"

log() { echo "[hf_env] $*" >&2; }

if [[ ! -x "${PY}" ]]; then
    log "creating ${VENV}"
    python3 -m venv "${VENV}"
fi

# Fast path: everything already present with the right versions, no fla.
check() {
    "${PY}" - "$TORCH_VERSION" "$TRANSFORMERS_VERSION" "${SAFETENSORS_SPEC#safetensors==}" <<'EOF'
import importlib.metadata as md, importlib.util, sys
want_torch, want_tf, want_st = sys.argv[1], sys.argv[2], sys.argv[3]
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
ok = True
t = ver("torch")
if t is None or t.split("+")[0] != want_torch:
    ok = False
if ver("transformers") != want_tf:
    ok = False
if ver("safetensors") != want_st:
    ok = False
for bad in ("fla-core", "flash-linear-attention", "flash-attn", "causal-conv1d", "kernels"):
    if ver(bad) is not None:
        ok = False
# Importable modules transformers would dispatch to (the repo's own kernels/
# folder is not the HF "kernels" distribution, checked above by metadata).
for mod in ("fla", "flash_attn", "causal_conv1d"):
    if importlib.util.find_spec(mod) is not None:
        ok = False
sys.exit(0 if ok else 1)
EOF
}

if check 2>/dev/null; then
    log "ok: .venv-hf already has torch==${TORCH_VERSION} transformers==${TRANSFORMERS_VERSION}"
    exit 0
fi

log "installing torch==${TORCH_VERSION} transformers==${TRANSFORMERS_VERSION} safetensors"
# pip's output (including the harmless "Location ... is ignored" warnings this
# machine's pip config produces) is kept in a log and shown only on failure.
PIPLOG="$(mktemp)"
trap 'rm -f "${PIPLOG}"' EXIT
if ! "${PY}" -m pip install --quiet --disable-pip-version-check \
    "torch==${TORCH_VERSION}" \
    "transformers==${TRANSFORMERS_VERSION}" \
    "${SAFETENSORS_SPEC}" >"${PIPLOG}" 2>&1; then
    cat "${PIPLOG}" >&2
    log "ERROR: pip install failed"
    exit 1
fi

# Remove fla / flash-attn if something pulled them in.
for bad in fla-core flash-linear-attention flash-attn causal-conv1d kernels; do
    if "${PY}" -m pip show --quiet "${bad}" >/dev/null 2>&1; then
        log "removing ${bad} (would make transformers use GPU kernels)"
        "${PY}" -m pip uninstall --quiet --yes "${bad}" >/dev/null
    fi
done

if ! check; then
    log "ERROR: .venv-hf does not satisfy the requirements after install"
    "${PY}" -m pip list --disable-pip-version-check >&2 || true
    exit 1
fi
log "ok: $("${PY}" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
