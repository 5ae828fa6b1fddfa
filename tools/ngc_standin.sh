#!/usr/bin/env bash
# Builds a stand-in for NGC's PyTorch image where the real one cannot be pulled (the container
# test): Debian bookworm from debootstrap, its Python 3.11 and pip, the torch and torchvision
# pinned in requirements.lock, and an /etc/pip/constraint.txt pinning those two, as NGC's images
# have. What only the real image has: NGC's own torch build, CUDA, NCCL, DALI.
# Usage (root, with buildah and debootstrap): tools/ngc_standin.sh TAG
# torch comes in with the project's uv (.venv/bin/uv) and from its cache when it is there; the
# machine's CA bundle is mounted for the downloads (a TLS-inspecting proxy's CA included).
set -euo pipefail
tag=${1:?usage: tools/ngc_standin.sh TAG}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
uv=$root/${VENV:-.venv}/bin/uv
ca=/etc/ssl/certs/ca-certificates.crt
[ -x "$uv" ] || { echo "ngc_standin: $uv missing: run ./run venv first" >&2; exit 1; }
mapfile -t pins < <(grep -Eo '^(torch|torchvision)==[^ ]+' "$root/requirements.lock")
[ "${#pins[@]}" = 2 ] || { echo "ngc_standin: no torch and torchvision pins in requirements.lock" >&2; exit 1; }

ctr=$(buildah from scratch)
trap 'buildah rm "$ctr" >/dev/null' EXIT
rootfs=$(buildah mount "$ctr")
debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
  bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
# NGC's pip installs into the system Python, as the project's Dockerfile does
rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
mkdir -p "$rootfs/etc/pip"
printf '%s\n' "${pins[@]}" >"$rootfs/etc/pip/constraint.txt"
cache=$("$uv" cache dir)
mkdir -p "$cache"
buildah run --isolation chroot -v "$ca:$ca:ro" -v "$cache:/uv-cache" -v "$uv:/opt/uv:ro" "$ctr" -- \
  env SSL_CERT_FILE="$ca" /opt/uv pip install --quiet --system --break-system-packages \
  --cache-dir /uv-cache --link-mode copy "${pins[@]}"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
buildah config --workingdir /workspace --cmd bash "$ctr"
buildah commit --quiet "$ctr" "$tag" >/dev/null
echo "ngc_standin: built $tag (${pins[*]})"
