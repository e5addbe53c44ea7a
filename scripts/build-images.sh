#!/usr/bin/env bash
# Builds the zerolayer service image without any container registry (the offline path of
# docs/compose.md; CI and the compose test use it).
#
#   scripts/build-images.sh [PATH/TO/zerolayer]
#
# Two steps:
# 1. A local base image `zerolayer-base:<method>-<hash>`, made once and reused while its tag
#    exists (the tag is a hash of what it is made from, so a changed recipe or changed host
#    files make a new one):
#    - method `rootfs` (default): a scratch-style root holding redis-server, redis-cli and
#      /bin/sh from the host's Debian packages and the shared libraries they and the binary
#      link (ldd), plus passwd and group files. About a second, no root, no network; 18 MB.
#      The host must have redis-server installed (installed with apt-get when missing and
#      possible; .ci/run installs it anyway).
#    - method `debootstrap`: `debootstrap --variant=minbase bookworm` from Debian's mirror with
#      redis-server, trimmed (no apt lists, .debs, docs, man pages, locales) and `docker
#      import`ed: a real Debian userland (shell, coreutils, apt), independent of what the host
#      has installed. Needs root (or sudo) and the mirror; about 50 s once per machine; 85 MB.
#    Measured on the 2-core CI kind (docs/compose.md): the whole compose test takes 30-34 s
#    from no images with `rootfs` and 88-132 s with `debootstrap`, which CI (a fresh machine
#    every run) would pay every time; hence the default.
# 2. The service image ($ZEROLAYER_IMAGE, default `zerolayer:local`) from
#    docker/Dockerfile.local: the base plus the given `zerolayer` binary. Docker's layer
#    cache makes this a no-op when the binary did not change.
#
# Environment:
#   ZEROLAYER_BIN           the binary when no argument names one (default:
#                           ${CARGO_TARGET_DIR:-target}/debug/zerolayer, built if missing)
#   ZEROLAYER_IMAGE         service image tag (default zerolayer:local)
#   ZEROLAYER_BASE_METHOD   rootfs (default) | debootstrap
#   ZEROLAYER_DEBIAN_MIRROR Debian mirror for debootstrap (default http://deb.debian.org/debian)
#   ZEROLAYER_REBUILD_BASE  1 = rebuild the base image even if its tag exists
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

IMAGE="${ZEROLAYER_IMAGE:-zerolayer:local}"
METHOD="${ZEROLAYER_BASE_METHOD:-rootfs}"
MIRROR="${ZEROLAYER_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm
# Packages added to the debootstrap base: redis-server for the layered baseline (its
# dependencies, redis-tools with redis-cli among them, come along).
BASE_PACKAGES='redis-server'
# The unprivileged user every service runs as. compose.yaml's tmpfs volume options and the
# registry Dockerfile use the same numbers: engine and front must share one uid, because the
# engine creates the segment with mode 0600.
APP_UID=10001
APP_GID=10001
# PATH of the imported base (`docker import` records no environment).
BASE_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { printf '[build-images %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/zerolayer-images.XXXXXX")"
# debootstrap leaves root-owned files behind: remove them with sudo only then.
cleanup() { rm -rf "$WORK" 2>/dev/null || ${SUDO} rm -rf "$WORK"; }
trap cleanup EXIT

# --- the binary ------------------------------------------------------------------------------
BIN="${1:-${ZEROLAYER_BIN:-}}"
if [ -z "$BIN" ]; then
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/debug/zerolayer"
    if [ ! -x "$BIN" ]; then
        log "building $BIN (cargo build -p zerolayer-cli)"
        cargo build -p zerolayer-cli
    fi
fi
[ -x "$BIN" ] || die "no executable zerolayer binary at $BIN"
BIN="$(readlink -f "$BIN")"
command -v docker >/dev/null || die "docker is not installed"

# The /etc/passwd and /etc/group lines of the service user (both methods).
passwd_line="zerolayer:x:${APP_UID}:${APP_GID}:zerolayer:/var/lib/zerolayer:/usr/sbin/nologin"
group_line="zerolayer:x:${APP_GID}:"

# --- method debootstrap ----------------------------------------------------------------------
build_base_debootstrap() {
    local dir="$WORK/rootfs"
    if ! command -v debootstrap >/dev/null; then
        command -v apt-get >/dev/null || die "debootstrap is missing and there is no apt-get to install it (use ZEROLAYER_BASE_METHOD=rootfs)"
        log "installing debootstrap"
        ${SUDO} apt-get update -qq
        DEBIAN_FRONTEND=noninteractive ${SUDO} apt-get install -y -qq debootstrap >/dev/null
    fi
    if [ "$(id -u)" != 0 ] && [ -z "$SUDO" ]; then
        die "debootstrap needs root or sudo (or use ZEROLAYER_BASE_METHOD=rootfs)"
    fi
    log "debootstrap --variant=minbase --include=$BASE_PACKAGES $SUITE from $MIRROR"
    ${SUDO} debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$dir" "$MIRROR" \
        >"$WORK/debootstrap.log" 2>&1 || { tail -n 30 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
    echo "$passwd_line" | ${SUDO} tee -a "$dir/etc/passwd" >/dev/null
    echo "$group_line" | ${SUDO} tee -a "$dir/etc/group" >/dev/null
    ${SUDO} install -d -o "$APP_UID" -g "$APP_GID" -m 0750 "$dir/var/lib/zerolayer"
    ${SUDO} install -d -o "$APP_UID" -g "$APP_GID" -m 0700 "$dir/var/lib/zerolayer/keys" "$dir/run/zerolayer"
    ${SUDO} install -d -o "$APP_UID" -g "$APP_GID" -m 0755 "$dir/out"
    # Trim what a runtime image never reads (the official slim images drop the same).
    ${SUDO} rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* \
        "$dir"/usr/share/doc/* "$dir"/usr/share/man/* "$dir"/usr/share/info/* \
        "$dir"/usr/share/locale/* "$dir"/var/log/*.log "$dir"/var/cache/debconf/*-old
    ${SUDO} tar -C "$dir" --numeric-owner -cf "$WORK/base.tar" .
}

# --- method rootfs ---------------------------------------------------------------------------
# The host paths of `exe` and of every library it links (ldd), one per line.
linked_files() {
    local exe="$1"
    echo "$exe"
    ldd "$exe" | awk '/=> \// { print $3 } /^\t\/[^ ]+ \(/ { print $1 }'
}

# Copies host file `src` into the root `dir`, dereferenced, at the path the loader or a user
# looks for (its directory's real path, merged-/usr aware, with its own name).
copy_into_root() {
    local dir="$1" src="$2" as="${3:-}"
    local real_dir
    real_dir="$(readlink -f "$(dirname "$src")")"
    mkdir -p "$dir$real_dir"
    cp -L "$src" "$dir$real_dir/${as:-$(basename "$src")}"
}

build_base_rootfs() {
    local dir="$WORK/rootfs"
    local redis sh_path f
    redis="$(command -v redis-server || true)"
    if [ -z "$redis" ]; then
        command -v apt-get >/dev/null || die "redis-server is not installed on this host"
        log "installing redis-server on the host (its binary goes into the image)"
        ${SUDO} apt-get update -qq
        DEBIAN_FRONTEND=noninteractive ${SUDO} apt-get install -y -qq redis-server >/dev/null
        redis="$(command -v redis-server)"
    fi
    sh_path="$(readlink -f /bin/sh)"
    mkdir -p "$dir"/usr/bin "$dir"/usr/lib "$dir"/usr/lib64 "$dir"/usr/sbin "$dir"/etc "$dir"/tmp
    # Merged /usr, as on Debian 12 (the interpreter path /lib64/ld-linux-x86-64.so.2 resolves).
    for d in bin sbin lib lib64; do ln -s "usr/$d" "$dir/$d"; done
    chmod 1777 "$dir/tmp"
    {
        linked_files "$redis"
        linked_files "$(command -v redis-cli)"
        linked_files "$sh_path"
        linked_files "$BIN" | tail -n +2 # the binary itself goes into the service image
    } | sort -u >"$WORK/files"
    while read -r f; do
        case "$f" in
            "$redis") copy_into_root "$dir" "$f" redis-server ;; # a symlink to redis-check-rdb on Debian; the name selects the mode
            *) copy_into_root "$dir" "$f" ;;
        esac
    done <"$WORK/files"
    # The loader's canonical path (ldd prints it as /lib64/…, which resolves into usr/lib64).
    [ -e "$dir/lib64/ld-linux-x86-64.so.2" ] || die "no dynamic loader copied (ldd output: $(cat "$WORK/files"))"
    ln -sf "$(basename "$sh_path")" "$dir/usr/bin/sh"
    printf 'root:x:0:0:root:/root:/usr/sbin/nologin\n%s\n' "$passwd_line" >"$dir/etc/passwd"
    printf 'root:x:0:\n%s\nnogroup:x:65534:\n' "$group_line" >"$dir/etc/group"
    printf 'hosts: files dns\n' >"$dir/etc/nsswitch.conf"
    # The directories the services write, owned by the service user (appended below with
    # that owner; their parents belong to root).
    mkdir -p "$dir/var/lib" "$dir/run" "$WORK/owned/var/lib/zerolayer/keys" "$WORK/owned/run/zerolayer" "$WORK/owned/out"
    chmod 0750 "$WORK/owned/var/lib/zerolayer"
    chmod 0700 "$WORK/owned/var/lib/zerolayer/keys" "$WORK/owned/run/zerolayer"
    chmod 0755 "$WORK/owned/out"
    # Deterministic archive: its hash names the base image, so an unchanged host reuses it.
    local tar_opts=(--sort=name --mtime=@0 --numeric-owner)
    tar -C "$dir" "${tar_opts[@]}" --owner=0 --group=0 -cf "$WORK/base.tar" .
    tar -C "$WORK/owned" "${tar_opts[@]}" --owner="$APP_UID" --group="$APP_GID" --no-recursion \
        -rf "$WORK/base.tar" ./var/lib/zerolayer ./var/lib/zerolayer/keys ./run/zerolayer ./out
}

# --- the base image --------------------------------------------------------------------------
case "$METHOD" in
    debootstrap)
        # Named by its recipe: the functions and settings that make it.
        recipe_hash="$(
            { declare -f build_base_debootstrap; echo "$SUITE $BASE_PACKAGES $MIRROR $passwd_line $group_line $BASE_PATH"; } |
                sha256sum | cut -c1-12
        )"
        BASE="zerolayer-base:debootstrap-$recipe_hash"
        ;;
    rootfs)
        BASE="" # named by content, known once the archive exists
        ;;
    *) die "ZEROLAYER_BASE_METHOD must be debootstrap or rootfs, not '$METHOD'" ;;
esac

import_base() {
    local tag="$1"
    log "docker import -> $tag ($(du -h "$WORK/base.tar" | cut -f1))"
    docker import \
        --change "ENV PATH=$BASE_PATH" \
        --change "LABEL io.zerolayer.image=base io.zerolayer.base-method=$METHOD" \
        "$WORK/base.tar" "$tag" >/dev/null
}

t0=$SECONDS
if [ "$METHOD" = debootstrap ]; then
    if [ "${ZEROLAYER_REBUILD_BASE:-0}" != 1 ] && docker image inspect "$BASE" >/dev/null 2>&1; then
        log "base image $BASE exists: reused"
    else
        build_base_debootstrap
        import_base "$BASE"
    fi
else
    build_base_rootfs
    BASE="zerolayer-base:rootfs-$(sha256sum "$WORK/base.tar" | cut -c1-12)"
    if [ "${ZEROLAYER_REBUILD_BASE:-0}" != 1 ] && docker image inspect "$BASE" >/dev/null 2>&1; then
        log "base image $BASE exists: reused"
    else
        import_base "$BASE"
    fi
fi
log "base image ready in $((SECONDS - t0)) s: $BASE"

# --- the service image -----------------------------------------------------------------------
t1=$SECONDS
ctx="$WORK/context"
mkdir -p "$ctx"
cp docker/Dockerfile.local "$ctx/Dockerfile"
# A hard link when possible (no copy of a large debug binary), else a copy.
ln "$BIN" "$ctx/zerolayer" 2>/dev/null || cp "$BIN" "$ctx/zerolayer"
old_id="$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
log "docker build $IMAGE from $BIN ($(du -h "$BIN" | cut -f1))"
docker build --quiet \
    --build-arg "BASE_IMAGE=$BASE" --build-arg "APP_UID=$APP_UID" --build-arg "APP_GID=$APP_GID" \
    --tag "$IMAGE" "$ctx" >/dev/null 2>"$WORK/build.err" || { cat "$WORK/build.err" >&2; die "docker build failed"; }
# Earlier builds of the service image, untagged by this one, are no use to anyone.
docker image prune --force --filter label=io.zerolayer.image=service >/dev/null 2>&1 || true
new_id="$(docker image inspect -f '{{.Id}}' "$IMAGE")"
if [ "$new_id" = "$old_id" ]; then reuse="unchanged: every layer came from the cache"; else reuse="new image ${new_id:7:12}"; fi
log "service image $IMAGE ready in $((SECONDS - t1)) s ($reuse)"
echo "$IMAGE"
