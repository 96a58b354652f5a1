#!/bin/sh
# `redis-server ARGS...` runs with protected mode off unless ARGS set it (as the upstream image does): inside
# a container the server is reached over the container network, never through a published loopback port.
set -e
if [ "${1:-}" = "redis-server" ]; then
    case " $* " in
        *" --protected-mode "*) ;;
        *) set -- "$@" --protected-mode no ;;
    esac
fi
exec "$@"
