#!/usr/bin/env bash
# Set up everything sglang-eaas needs in ./.venv (override with SGLANG_EAAS_VENV).
#   * No CUDA GPU: the CPU recipe -- torch 2.13.0 CPU build, sglang==0.5.23 with --no-deps plus
#     requirements/sglang-cpu.txt, triton, and the CPU runtime start-up hook (docs/cpu-runtime.md).
#   * CUDA GPU: SGLang's normal GPU stack (pip install sglang==0.5.23 with its dependencies).
#   * Then this package in editable mode with its test extras.
# Idempotent: when nothing that feeds the install changed, it finishes in about a second.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SGLANG_EAAS_VENV:-$root/.venv}"
python="${PYTHON:-python3}"

die() { echo "setup: error: $*" >&2; exit 1; }
step() { echo "setup: $*"; }

command -v "$python" >/dev/null || die "'$python' not found; install Python >= 3.10 or set PYTHON=/path/to/python3"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || die "Python >= 3.10 is required, '$python' is $("$python" -V 2>&1); set PYTHON=/path/to/python3.10+"
command -v cc >/dev/null || command -v gcc >/dev/null \
  || die "no C compiler found (Triton and native extensions need one); install gcc (Debian: apt-get install -y gcc)"
command -v "${CXX:-c++}" >/dev/null || command -v g++ >/dev/null \
  || die "no C++ compiler found (the expert server's CPU kernel needs one); install g++ (Debian: apt-get install -y g++)"

if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  mode=gpu
else
  mode=cpu
fi

# Debian packages, installed when missing (as root; CI runs as root).
apt_install() {
  local quiet=(env DEBIAN_FRONTEND=noninteractive apt-get -y -q)
  "${quiet[@]}" install --no-install-recommends "$@" >/dev/null \
    || { "${quiet[@]}" update >/dev/null && "${quiet[@]}" install --no-install-recommends "$@" >/dev/null; }
}

# Mooncake (ibgda's cross-host backend) loads Debian's libibverbs1 at import, RDMA or not.
# Checked on every run: a cached venv may meet a fresh machine. ldconfig's listing is read whole
# first: with pipefail, 'ldconfig -p | grep -q' fails when grep quits early and ldconfig gets SIGPIPE.
linker_cache="$(ldconfig -p 2>/dev/null || true)"
if ! grep -q 'libibverbs\.so\.1' <<<"$linker_cache"; then
  [[ $(id -u) == 0 ]] || die "Mooncake needs libibverbs1: run 'sudo apt-get install -y libibverbs1', then this again"
  step "installing Debian's libibverbs1 (for Mooncake)"
  apt_install libibverbs1 || die "could not install libibverbs1 with apt-get"
fi

# etcd (the monitor's multi-host backend, etcd://; its tests start one on loopback): Debian's
# etcd-server. Only the tests need it on this machine, so without root it is a warning.
if ! command -v etcd >/dev/null; then
  if [[ $(id -u) == 0 ]]; then
    step "installing Debian's etcd-server (for the etcd monitor's tests)"
    apt_install etcd-server || die "could not install etcd-server with apt-get"
    # The package may start a system etcd on the default ports; the tests start their own.
    { command -v systemctl >/dev/null && systemctl stop etcd 2>/dev/null; } || true
  else
    echo "setup: warning: etcd is not installed ('sudo apt-get install -y etcd-server'); the etcd monitor's tests will fail" >&2
  fi
fi

stamp_file="$venv/.sglang-eaas-setup"
stamp="$(cat "$root/setup.py" "$root/scripts/setup.sh" "$root/requirements/"*.txt \
  "$root/sgl-kernel-ext/csrc/cpu/"* "$root/sgl-kernel-ext/sgl_kernel_ext/cpu_ops.py" | sha256sum | cut -d' ' -f1) $mode $("$python" -V 2>&1)"
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
  # A venv kept from another checkout (a CI cache) lacks this checkout's in-place native build,
  # and its editable install names the other checkout (whose code it would import if it is
  # still there).
  if ! "$venv/bin/python" -c "import ibgda._host_atomics, sglang_eaas, sys; sys.exit(not (
      ibgda._host_atomics.__file__.startswith('$root/') and sglang_eaas.__file__.startswith('$root/')))" \
      2>/dev/null; then
    step "installing this checkout and building ibgda's native module into it (the venv is kept from another)"
    if ! built="$("$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
        --no-deps --no-build-isolation -e "$root" 2>&1)"; then  # setuptools' warnings: noise
      echo "$built" >&2
      die "building ibgda's native module failed (see above)"
    fi
  fi
  step "$venv is up to date ($mode)"
  exit 0
fi

step "creating $venv ($mode machine)"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
# pip's warnings about this machine's unused local index folders are noise; errors still show.
pip_install() {
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}
pip_install --upgrade pip
if [[ $mode == cpu ]]; then
  # torch==2.13.0 on PyPI alone is the CUDA build (several GB); PyTorch's CPU index is searched
  # too when it can be reached (SGLANG_EAAS_TORCH_INDEX; empty: pip's own indexes only, as on
  # machines whose pip is set up to find the CPU build).
  torch_index="${SGLANG_EAAS_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
  if [[ -n $torch_index ]] && ! "$venv/bin/python" -c "import socket, sys, urllib.parse
socket.getaddrinfo(urllib.parse.urlsplit(sys.argv[1]).hostname, 443)" "$torch_index" 2>/dev/null; then
    step "PyTorch's CPU index ($torch_index) cannot be reached; torch from pip's own indexes"
    torch_index=""
  fi
  step "[1/7] torch 2.13.0 (CPU build)"
  pip_install ${torch_index:+--extra-index-url "$torch_index"} "torch==2.13.0"
  step "[2/7] sglang 0.5.23 without its CUDA kernel dependencies"
  pip_install --no-deps "sglang==0.5.23"
  step "[3/7] SGLang's pure-Python runtime dependencies and triton (requirements/sglang-cpu.txt)"
  pip_install -r "$root/requirements/sglang-cpu.txt"
  step "[4/7] Mooncake Transfer Engine, CPU build, and what the device backend's CUDA sources" \
    "compile with (requirements/ibgda-cpu.txt, requirements/ibgda-cuda-build.txt)"
  pip_install -r "$root/requirements/ibgda-cpu.txt" -r "$root/requirements/ibgda-cuda-build.txt"
  step "[5/7] sglang-eaas (editable, with test and benchmark extras; builds ibgda's native module)"
  pip_install -e "$root[test,bench]"
  step "[6/7] CPU runtime start-up hook"
  "$venv/bin/python" -m sglang_eaas.cpu_runtime install
else
  step "[1/4] sglang 0.5.23 with its GPU stack, and Mooncake's CUDA build (untested)"
  pip_install "sglang==0.5.23" mooncake-transfer-engine -r "$root/requirements/ibgda-cuda-build.txt"
  step "[2/4] sglang-eaas (editable, with test and benchmark extras)"
  pip_install -e "$root[gpu,test,bench]"
  step "[3/4] ibgda's device backend, native side (python -m ibgda.build_native; never run)"
  "$venv/bin/python" -m ibgda.build_native
fi
# Compiled here once, so an expert server's first start does not pay for it (sgl_kernel_ext.cpu_ops;
# the build lives in the venv, keyed by the source: a changed source rebuilds).
step "[$([[ $mode == cpu ]] && echo 7/7 || echo 4/4)] building the CPU expert kernel" \
  "(sgl-kernel-ext/csrc/cpu, with torch's extension tooling)"
"$venv/bin/python" -m sgl_kernel_ext.cpu_ops || die "building the CPU expert kernel failed (see above)"
echo "$stamp" > "$stamp_file"
step "done: activate with 'source $venv/bin/activate'"
