#!/usr/bin/env bash
# Installs what feature `nixl` needs at build and run time, under target/nixl/ (nothing of it is
# committed): libclang for nixl-sys's bindgen (from Debian, only if missing), and NIXL's C library
# from the pinned PyPI wheel `nixl-cu12==1.5.1`, hash checked, of which only the two library
# folders are unpacked. Then `source target/nixl/env.sh` sets the run-time environment.
# Facts and versions: ../shared/TRANSFER-ENGINE.md of the project; idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD/target/nixl"
mkdir -p "$root"

have_libclang() {
    [ -n "${LIBCLANG_PATH:-}" ] && ls "$LIBCLANG_PATH"/libclang*.so* >/dev/null 2>&1 && return 0
    ldconfig -p 2>/dev/null | grep -q 'libclang\(-[0-9.]*\)\?\.so' && return 0
    ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1
}

if ! have_libclang; then
    echo "install-nixl: libclang is missing (nixl-sys's bindgen needs it); installing libclang-dev"
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "install-nixl: cannot install libclang-dev here (needs root and apt-get)." >&2
        echo "  Install libclang (Debian/Ubuntu: apt-get install libclang-dev), or set LIBCLANG_PATH" >&2
        echo "  to the folder holding libclang.so, then run this script again." >&2
        exit 1
    fi
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libclang-dev >/dev/null
fi

lib="$root/lib"
if [ ! -e "$lib/.nixl_cu12.mesonpy.libs/libnixl_capi.so" ]; then
    echo "install-nixl: downloading nixl-cu12 1.5.1 (the pinned wheel, hash checked)"
    printf '%s\n' 'nixl-cu12==1.5.1 --hash=sha256:341d0dfa499f941c054614252f1d8047d1380e33f29c87707372ff5ec7d3779a' \
        >"$root/requirements.txt"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --require-hashes -r "$root/requirements.txt" -d "$root/wheel"
    python3 - "$root/wheel" "$lib" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("nixl_cu12-1.5.1-*.whl"))
keep = (".nixl_cu12.mesonpy.libs/", "nixl_cu12.libs/")
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.filename.startswith(keep):
            z.extract(info, sys.argv[2])
PY
    # zipfile drops the permission bits: the libraries must be loadable.
    chmod -R u+rwX,go+rX "$lib"
    rm -rf "$root/wheel"
fi

cat >"$root/env.sh" <<ENV
# Run-time settings for feature \`nixl\` (written by scripts/install-nixl.sh).
export LD_LIBRARY_PATH="$lib/.nixl_cu12.mesonpy.libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export NIXL_PLUGIN_DIR="$lib/.nixl_cu12.mesonpy.libs/plugins"
# Loopback only, and no InfiniBand module (it crashes at exit where ibverbs providers exist).
export UCX_NET_DEVICES=lo
export UCX_MODULES=^ib
ENV
echo "install-nixl: ready; run-time settings in target/nixl/env.sh"
