# The warmpath image: one binary (router, agent, engine-sim, certs, admin) on a slim
# Debian, run as an unprivileged user. Used by deploy/compose and deploy/helm:
#   docker build -t ghcr.io/warmpath/warmpath:0.1.0 .
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin warmpath

FROM debian:bookworm-slim
# The chart's router pods and the compose file's start scripts need sh and hostname
# (both in the base image); nothing else is installed.
COPY --from=build /src/target/release/warmpath /usr/local/bin/warmpath
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/warmpath"]
