#!/usr/bin/env bash
# make image / make image-test: build the container images, and smoke-test the verifier image.
#
#   scripts/image.sh build [verifier|edge|all]   build images (default: all)
#   scripts/image.sh test                        build the verifier image, run it with the SmolLM2
#                                                target, wait for /readyz, generate from the host and
#                                                check the tokens equal target-only decoding; build
#                                                the edge image and check the same from inside it;
#                                                stop the verifier
#
# Engine: $CONTAINER_ENGINE, else docker when its daemon answers and there is no podman, else podman
# (on a Debian machine as root, podman, runc and debootstrap are installed with apt when missing).
# Base: python:3.11-slim-bookworm from the registry when it can be pulled; otherwise (no registry
# reachable, as on the development machines) a Debian bookworm base is made with debootstrap from
# the Debian mirror apt uses, kept as a tarball in the work folder outside the repository
# ($TREESPEC_IMAGE_WORK, default ~/.cache/treespec/image) and imported once (treespec/debian-base).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# work files and the cached Debian base live outside the repository (kept between clones and CI runs)
WORK=${TREESPEC_IMAGE_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/treespec/image}
mkdir -p "$WORK"
say() { echo "[image] $*" >&2; }

# podman, runc and debootstrap, whichever is missing, with apt (as root on Debian); false when it can't
apt_podman() {
  local missing=() tool
  for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} = 0 ] && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  say "installing ${missing[*]} with apt"
  apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
}

engine() {
  if [ -n "${CONTAINER_ENGINE:-}" ]; then echo "$CONTAINER_ENGINE"; return; fi
  if command -v docker >/dev/null && ! command -v podman >/dev/null && docker info >/dev/null 2>&1; then
    echo docker; return
  fi
  if apt_podman || command -v podman >/dev/null; then echo podman; return; fi
  say "no container engine: install podman (or docker), or set CONTAINER_ENGINE"; exit 2
}

ENGINE=$(engine)
BUILD_FLAGS=()
RUN_FLAGS=()
if [ "$(basename "$ENGINE")" = podman ]; then
  # rlimits cannot be set in these sandboxes and crun fails on their cgroups: runc, no ulimits
  CONF="$WORK/containers.conf"
  printf '[containers]\ndefault_ulimits = []\n' > "$CONF"
  export CONTAINERS_CONF="${CONTAINERS_CONF:-$CONF}"
  RT=()
  command -v runc >/dev/null && RT=(--runtime runc)
  BUILD_FLAGS=("${RT[@]}" --network host --isolation chroot --format docker)
  RUN_FLAGS=("${RT[@]}" --network host)
  # local wheels (a CPU torch) and the pip cache (a built llama-cpp-python) are used when present
  [ -d /opt/wheels ] && BUILD_FLAGS+=(-v /opt/wheels:/opt/wheels:ro)
  [ -d "$HOME/.cache/pip" ] && BUILD_FLAGS+=(-v "$HOME/.cache/pip:/root/.cache/pip")
else
  BUILD_FLAGS=(--network host)
  RUN_FLAGS=(--network host)
fi
# a TLS-intercepting proxy on the way to the package index: pip inside needs the host's CA bundle
HOST_CA=${PIP_CERT:-}
if [ -n "$HOST_CA" ] && [ -f "$HOST_CA" ]; then
  if [ "$(basename "$ENGINE")" = podman ]; then
    BUILD_FLAGS+=(-v "$HOST_CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
  fi
  RUN_FLAGS+=(-v "$HOST_CA:/run/host-ca.crt:ro" -e PIP_CERT=/run/host-ca.crt)
fi

base_image() {
  local remote=docker.io/library/python:3.11-slim-bookworm local=treespec/debian-base:bookworm
  if "$ENGINE" image exists "$local" 2>/dev/null || "$ENGINE" image inspect "$local" >/dev/null 2>&1; then
    echo "$local"; return
  fi
  local saved="$WORK/debian-base-bookworm.tar"
  if [ -s "$saved" ]; then
    say "importing the cached Debian base $saved"
    "$ENGINE" import - "$local" <"$saved" >&2
    echo "$local"; return
  fi
  if timeout 60 "$ENGINE" pull -q "$remote" >/dev/null 2>&1; then echo "$remote"; return; fi
  say "no image registry reachable: making a Debian bookworm base with debootstrap (once, ~3 min; cached in $WORK)"
  command -v debootstrap >/dev/null || { say "needs debootstrap (apt-get install debootstrap)"; exit 2; }
  local mirror
  mirror=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
  mirror=${mirror:-$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
  mirror=${mirror:-http://deb.debian.org/debian}
  local rootfs="$WORK/rootfs"
  rm -rf "$rootfs"
  debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >&2
  tar -C "$rootfs" -c . >"$saved.part" && mv "$saved.part" "$saved"
  "$ENGINE" import - "$local" <"$saved" >&2
  rm -rf "$rootfs"
  echo "$local"
}

build() {
  local which=$1 base torch_args
  base=$(base_image)
  torch_args="--index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple"
  # a CPU torch wheel on the build machine (pip's find-links here) wins: 2.13.0+cpu sorts above 2.13.0
  if [ -d /opt/wheels ] && ls /opt/wheels/torch-*+cpu-*.whl >/dev/null 2>&1; then
    torch_args="--find-links /opt/wheels"
  fi
  for name in $which; do
    say "building treespec/$name from $base with $ENGINE"
    local t0=$SECONDS
    "$ENGINE" build "${BUILD_FLAGS[@]}" --build-arg BASE="$base" --build-arg TORCH_PIP_ARGS="$torch_args" \
      -f "docker/Containerfile.$name" -t "treespec/$name:latest" . >&2
    say "treespec/$name built in $((SECONDS - t0)) s; size: $("$ENGINE" image inspect "treespec/$name:latest" --format '{{.Size}}') bytes"
  done
}

# the edge image against the running verifier: its greedy tokens (tree speculation, SmolLM2 draft in
# llama.cpp) equal its target-only `ar` tokens, and `edge-client serve` starts
edge_check() {
  local port=$1 cache=$2 url="ws://127.0.0.1:$1/v1/session" prompt="Write a haiku about rain."
  build edge
  local run=("$ENGINE" run --rm "${RUN_FLAGS[@]}" -v "$cache:/cache" treespec/edge:latest)
  local tree ar
  tree=$("${run[@]}" generate --server "$url" --draft smollm2-135m-q4 --max-new-tokens 32 --json "$prompt") || return 1
  ar=$("${run[@]}" generate --server "$url" --draft smollm2-135m-q4 --max-new-tokens 32 --mode ar --json "$prompt") || return 1
  "${PYTHON:-.venv/bin/python}" - "$tree" "$ar" <<'PY' || return 1
import json, sys
tree, ar = (json.loads(s.strip().splitlines()[-1]) for s in sys.argv[1:3])
same = tree["tokens"] == ar["tokens"] and len(ar["tokens"]) > 0
print(f"edge-check: edge image greedy == edge image ar ({len(ar['tokens'])} tokens, tau {tree['stats']['tau']:.2f}): {same}")
sys.exit(0 if same else 1)
PY
  "${run[@]}" serve --help >/dev/null || { say "edge-client serve does not start in the edge image"; return 1; }
  echo "edge-check: edge-client serve --help runs in the edge image"
}

smoke_test() {
  build verifier
  local port=${TREESPEC_IMAGE_TEST_PORT:-18765} name=treespec-verifier-test cache="$WORK/cache"
  mkdir -p "$cache" && chmod 777 "$cache"
  "$ENGINE" rm -f "$name" >/dev/null 2>&1 || true
  say "running the verifier image (SmolLM2-135M target) on port $port"
  "$ENGINE" run -d --name "$name" "${RUN_FLAGS[@]}" -v "$cache:/cache" \
    -e CLOUD_VERIFIER_PORT="$port" -e CLOUD_VERIFIER_HOST=127.0.0.1 \
    treespec/verifier:latest serve --model smollm2-135m --max-context 2048 >/dev/null
  # shellcheck disable=SC2064  # expand now: the names are local to this function
  trap "'$ENGINE' rm -f '$name' >/dev/null 2>&1 || true" EXIT
  local status=0
  "${PYTHON:-.venv/bin/python}" -m tests.cloud_verifier.image_check --url "ws://127.0.0.1:$port/v1/session" \
    --user-check "$ENGINE exec $name id -u" --timeout 900 || status=$?
  [ "$status" = 0 ] || "$ENGINE" logs --tail 40 "$name" >&2 || true
  [ "$status" = 0 ] && { edge_check "$port" "$cache" || status=$?; }
  "$ENGINE" stop -t 30 "$name" >/dev/null 2>&1 || true
  say "image test: $([ "$status" = 0 ] && echo passed || echo FAILED)"
  return $status
}

case "${1:-build}" in
  build) which=${2:-all}; [ "$which" = all ] && which="verifier edge"; build "$which" ;;
  test) smoke_test ;;
  *) echo "usage: $0 build [verifier|edge] | test" >&2; exit 2 ;;
esac
