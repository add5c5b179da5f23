# syntax=docker/dockerfile:1
# ledger-limiter service image.
#
#   docker build -t ledger-limiter:dev .
#
# The TigerBeetle client (tigerbeetle-unofficial-sys) is built from source with Zig and bindgen:
# Zig 0.14.1 comes from PyPI (`ziglang`), libclang and clang's headers from Debian. ZIG_PATH set in
# the environment wins over the `[env]` default in .cargo/config.toml (which has no `force`), so
# the build never tries to download Zig.
#
# The builder's Rust must be at least the highest `rust-version` among the locked dependencies that
# the binary uses (actix-web 4.18 and uuid 1.29 need 1.89), not only the package's own.

FROM rust:1.95-bookworm AS builder

# Debian package versions move with bookworm's point releases; the image tags are what is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-pip libclang-dev clang \
 && rm -rf /var/lib/apt/lists/*

RUN pip install --no-cache-dir --break-system-packages ziglang==0.14.1

# Where Debian's pip (as root, Python 3.11) puts it: <site-packages>/ziglang/zig.
ENV ZIG_PATH=/usr/local/lib/python3.11/dist-packages/ziglang/zig
RUN test -x "$ZIG_PATH" || { echo "no zig at $ZIG_PATH; ziglang is at: $(python3 -c 'import ziglang, os; print(os.path.dirname(ziglang.__file__))')" >&2; exit 1; } \
 && "$ZIG_PATH" version

WORKDIR /app
COPY . .
# Zig's cache lives outside target/ (ZIG_LOCAL_CACHE_DIR); both are BuildKit cache mounts, so a
# rebuild after a source change does not rebuild the TigerBeetle client (about 5 minutes). The
# binary is copied out of the cache mount into the image layer.
ENV ZIG_LOCAL_CACHE_DIR=/zig-cache
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/zig-cache \
    --mount=type=cache,target=/app/target-cache \
    cargo build --release --locked --bin ledger-limiter --target-dir /app/target-cache \
 && mkdir -p /app/target/release \
 && cp /app/target-cache/release/ledger-limiter /app/target/release/ledger-limiter

FROM debian:bookworm-slim

# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 ledger \
 && useradd --system --uid 10001 --gid ledger --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin ledger

COPY --from=builder /app/target/release/ledger-limiter /usr/local/bin/ledger-limiter

USER 10001:10001
ENV LEDGER_LIMITER_LISTEN=0.0.0.0:8080
EXPOSE 8080
# The TigerBeetle client uses io_uring: run with --security-opt seccomp=unconfined (Docker 25+).
ENTRYPOINT ["/usr/local/bin/ledger-limiter"]
